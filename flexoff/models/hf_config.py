"""A checkpoint's Hugging Face ``config.json`` as a ModelConfig: what flexoff can run is read field by
field, and what it cannot is refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..errors import ConfigError, UnknownModelError, UnsupportedModelError
from .config import (ROPE_KINDS, ModelConfig, RopeScaling, boolean_rule, is_int, size_rule, validate_fields,
                     validate_model, validate_rope)
from .gguf_config import config_from_gguf, gguf_path

_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
# Types whose sliding window is on unless the config turns it off.
_WINDOWED = ("mistral", "mixtral")
# Types that bias q, k and v (and not o) by default; the others bias o_proj too when asked, which
# flexoff does not load.
_QKV_BIASED = ("qwen2", "qwen2_moe")
_REQUIRED = object()

# ModelConfig field -> (its key in config.json, its default when the key is absent or null).
_COMMON_KEYS = {
    "vocab_size": ("vocab_size", _REQUIRED), "hidden_size": ("hidden_size", _REQUIRED),
    "num_layers": ("num_hidden_layers", _REQUIRED), "num_heads": ("num_attention_heads", _REQUIRED),
    "max_positions": ("max_position_embeddings", _REQUIRED),
    "bos_token_id": ("bos_token_id", None), "eos_token_ids": ("eos_token_id", None),
    "pad_token_id": ("pad_token_id", None),
}
_OPT_KEYS = {
    **_COMMON_KEYS, "intermediate_size": ("ffn_dim", _REQUIRED), "word_embed_proj_dim": ("word_embed_proj_dim", 0),
    "do_layer_norm_before": ("do_layer_norm_before", True),
    "remove_final_layer_norm": ("_remove_final_layer_norm", False), "enable_bias": ("enable_bias", True),
    "tie_word_embeddings": ("tie_word_embeddings", True),
}
_LLAMA_KEYS = {
    **_COMMON_KEYS, "intermediate_size": ("intermediate_size", _REQUIRED),
    "num_kv_heads": ("num_key_value_heads", 0), "head_dim": ("head_dim", 0), "norm_eps": ("rms_norm_eps", 1e-6),
    "tie_word_embeddings": ("tie_word_embeddings", False),
}


def config_from_dir(path: str | Path) -> ModelConfig:
    """Read a Hugging Face ``config.json`` into a ModelConfig, refusing what we cannot run and
    naming the file and the field of any value out of type or range. A GGUF file, or a directory
    holding one and no config.json, is read from its metadata (see gguf_config)."""
    path = Path(path)
    gguf = gguf_path(path)
    if gguf is not None:
        return config_from_gguf(gguf)
    config_file = path / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise UnknownModelError(f"{path} has no config.json, so it is not a checkpoint directory") from None
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot read {config_file}: {exc}") from None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"{config_file} is not a JSON object")
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise UnsupportedModelError(
            f"{path} is already quantized ({method}); flexoff loads fp16/bf16/fp32 checkpoints and "
            "compresses them itself (--compress-weight)"
        )
    model_type = raw.get("model_type")
    where = str(config_file)
    try:
        if model_type == "opt":
            values, names = _opt_from_json(where, raw)
        elif model_type in _LLAMA_TYPES:
            values, names = _llama_from_json(where, raw)
        else:
            raise UnsupportedModelError(
                f"{path}: model_type {model_type!r} is not supported; supported: opt, " + ", ".join(_LLAMA_TYPES))
    except KeyError as exc:
        raise UnsupportedModelError(f"{config_file} lacks the field {exc.args[0]!r}") from None
    # transformers 4 writes torch_dtype, 5 writes dtype; float32 exports run in fp16, as vLLM does.
    stored = raw.get("torch_dtype", raw.get("dtype"))
    values["native_dtype"] = "bfloat16" if stored == "bfloat16" else "float16"
    validate_model(values, where, names)
    for key in ("norm_eps", "rope_theta"):
        if key in values:
            values[key] = float(values[key])
    return ModelConfig(name=path.name, **values)


def _read_fields(raw: dict, keys: dict) -> tuple[dict, dict]:
    """(ModelConfig values as config.json gives them, the config.json name of each); ``keys`` maps a
    field to its key and its default (_REQUIRED: the key must be there)."""
    values, names = {}, {}
    for name, (key, default) in keys.items():
        if key not in raw and default is _REQUIRED:
            raise KeyError(key)
        value = raw.get(key)
        values[name] = default if value is None and default is not _REQUIRED else value
        names[name] = key
    return values, names


def _read_keys(raw: dict, keys: dict) -> tuple[dict, dict]:
    """The common fields of ``keys`` (see _read_fields), token ids in the form ModelConfig takes them."""
    values, names = _read_fields(raw, keys)
    values["eos_token_ids"] = _eos_tuple(values["eos_token_ids"])
    if is_int(values["pad_token_id"]) and values["pad_token_id"] < 0:
        values["pad_token_id"] = None  # some exports write -1 for "no padding token"
    return values, names


def _eos_tuple(value):
    """config.json's eos_token_id (one id, a list, or null) as a tuple; any other value is passed on
    for validation to refuse."""
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(value)
    return (value,) if is_int(value) else value


def _opt_from_json(where: str, raw: dict) -> tuple[dict, dict]:
    activation = raw.get("activation_function", "relu")
    if activation != "relu":
        raise UnsupportedModelError(f"{where}: OPT activation {activation!r} is not supported (only relu)")
    values, names = _read_keys(raw, _OPT_KEYS)
    return {"family": "opt", **values}, names


def _llama_from_json(where: str, raw: dict) -> tuple[dict, dict]:
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModelError(f"{where}: activation {activation!r} is not supported (only silu)")
    model_type = raw["model_type"]
    bias_key = "qkv_bias" if model_type == "qwen2_moe" and "qkv_bias" in raw else "attention_bias"
    switches = {"mlp_bias": raw.get("mlp_bias", False),
                "use_sliding_window": raw.get("use_sliding_window", model_type in _WINDOWED),
                bias_key: raw.get(bias_key, model_type in _QKV_BIASED)}
    switches = {key: value for key, value in switches.items() if value is not None}
    validate_fields(switches, dict.fromkeys(switches, boolean_rule), where)
    if switches.get("mlp_bias"):
        raise UnsupportedModelError(f"{where}: MLP biases are not supported")
    if model_type not in _QKV_BIASED and switches.get(bias_key):  # transformers then biases o_proj too
        raise UnsupportedModelError(f"{where}: attention_bias true is not supported for {model_type}")
    values, names = _read_keys(raw, _LLAMA_KEYS)
    values["attention_bias"] = switches.get(bias_key, False)
    names["attention_bias"] = bias_key
    values["qk_norm"] = model_type in ("qwen3", "qwen3_moe")
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):
        moe_values, moe_names = _experts_from_json(where, raw, values["num_layers"])
        values.update(moe_values)
        names.update(moe_names)
    if values["qk_norm"] and raw.get("head_dim") is None:
        values["head_dim"] = 128  # transformers' Qwen3 default, not hidden_size / num_attention_heads
    window = raw.get("sliding_window")
    if switches.get("use_sliding_window") and window is not None:
        validate_fields({"max_positions": values["max_positions"], "sliding_window": window},
                        {"max_positions": size_rule(), "sliding_window": size_rule()}, where, names)
        # Within the window, sliding-window attention equals full attention.
        values["max_positions"] = min(values["max_positions"], window)
    values["rope_theta"], values["rope_scaling"], rope_names = _rope_from_json(where, raw)
    return {"family": "llama", **values}, {**names, **rope_names}


def _rope_from_json(where: str, raw: dict) -> tuple[object, RopeScaling, dict]:
    """(theta, scaling, names) from either layout: newer exports nest theta and scaling in rope_parameters."""
    params, names = {}, {}
    for section in ("rope_scaling", "rope_parameters"):
        part = raw.get(section)
        if part is not None and not isinstance(part, dict):
            raise ConfigError(f"{where}: {section} must be an object or null, got {part!r}")
        params.update(part or {})
        names.update({key: f"{section}.{key}" for key in part or {}})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    names = {"rope_theta": names.get("rope_theta", "rope_theta"), "factor": names.get("factor"),
             "low_freq_factor": names.get("low_freq_factor"), "high_freq_factor": names.get("high_freq_factor"),
             "original_max_positions": names.get("original_max_position_embeddings")}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, RopeScaling(), names
    if kind == "linear":
        values = {"kind": kind, "factor": params["factor"]}
    elif kind == "llama3":
        values = {"kind": kind, "factor": params["factor"], "low_freq_factor": params["low_freq_factor"],
                  "high_freq_factor": params["high_freq_factor"],
                  "original_max_positions": params["original_max_position_embeddings"]}
    else:
        raise UnsupportedModelError(f"{where}: RoPE scaling {kind!r} is not supported ({', '.join(ROPE_KINDS)})")
    validate_rope({**dataclasses.asdict(RopeScaling()), **values}, where, names)
    floats = {key: float(value) if key not in ("kind", "original_max_positions") else value
              for key, value in values.items()}
    return theta, RopeScaling(**floats), {"rope_theta": names["rope_theta"]}


def _experts_from_json(where: str, raw: dict, layers: int) -> tuple[dict, dict]:
    """The mixture-of-experts fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json."""
    model_type = raw["model_type"]
    mixtral = model_type == "mixtral"
    # transformers 5 writes num_local_experts for every family; Qwen's own configs say num_experts.
    count_key = next((key for key in ("num_local_experts", "num_experts") if raw.get(key) is not None),
                     "num_local_experts" if mixtral else "num_experts")
    keys = {"num_experts": (count_key, _REQUIRED), "experts_per_token": ("num_experts_per_tok", _REQUIRED)}
    if not mixtral:  # Mixtral's experts are intermediate_size wide and always renormalised
        keys.update({"expert_intermediate_size": ("moe_intermediate_size", _REQUIRED),
                     "norm_topk_prob": ("norm_topk_prob", False)})
    if model_type == "qwen2_moe":
        keys["shared_expert_intermediate_size"] = ("shared_expert_intermediate_size", _REQUIRED)
    values, names = _read_fields(raw, keys)
    if mixtral:
        return values, names
    step, only = raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
    validate_fields({"decoder_sparse_step": step}, {"decoder_sparse_step": size_rule()}, where)
    if not isinstance(only, list) or not all(is_int(i) and 0 <= i < layers for i in only):
        raise ConfigError(f"{where}: mlp_only_layers must be a list of layer indices below "
                          f"num_hidden_layers ({layers}), got {only!r}")
    # transformers gives a layer experts where it is not listed and its number + 1 is a multiple of the step.
    values["dense_layers"] = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    names["dense_layers"] = "mlp_only_layers"
    return values, names

