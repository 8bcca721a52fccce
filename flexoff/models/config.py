"""Model configurations: a table of named sizes, and a reader for a checkpoint's ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, UnknownModelError, UnsupportedModelError
from ..hub import hub_checkpoint, is_hub_id

FAMILIES = ("opt", "llama")


# Checks of one field's value: each returns what the value must be, or None when it is fine.
_MAX_SIZE = 2**31 - 1  # no real dimension comes near; a larger one is a typo that would overflow shapes
_MAX_LAYERS = 10_000  # real models have a few hundred; each layer becomes a stage before any check of size


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _size(limit: int = _MAX_SIZE, minimum: int = 1):
    def check(value):
        if not _is_int(value) or value < minimum:
            return "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        return f"at most {limit}" if value > limit else None
    return check


def _positive_number(value):
    # NaN, infinities and non-positive values (an epsilon of 0, a RoPE base of -1) make the model compute NaN.
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return None if ok else "a positive finite number"


def _boolean(value):
    return None if isinstance(value, bool) else "true or false"


def _optional_token(value):
    return None if value is None or (_is_int(value) and value >= 0) else "a non-negative integer token id or null"


def _tokens(value):
    ok = isinstance(value, tuple) and all(_is_int(t) and t >= 0 for t in value)
    return None if ok else "a non-negative integer token id or a list of them"


_MODEL_RULES = {
    "vocab_size": _size(), "hidden_size": _size(), "num_layers": _size(_MAX_LAYERS), "num_heads": _size(),
    "intermediate_size": _size(), "max_positions": _size(),
    "num_kv_heads": _size(minimum=0), "head_dim": _size(minimum=0), "word_embed_proj_dim": _size(minimum=0),
    "norm_eps": _positive_number, "rope_theta": _positive_number,
    "tie_word_embeddings": _boolean, "do_layer_norm_before": _boolean, "remove_final_layer_norm": _boolean,
    "enable_bias": _boolean, "attention_bias": _boolean, "qk_norm": _boolean,
    "bos_token_id": _optional_token, "pad_token_id": _optional_token, "eos_token_ids": _tokens,
    "rope_scaling": lambda value: None if isinstance(value, RopeScaling) else "a RopeScaling",
}
ROPE_KINDS = ("default", "linear", "llama3")
_ROPE_RULES = {"kind": lambda value: None if value in ROPE_KINDS else "one of " + ", ".join(ROPE_KINDS),
               "factor": _positive_number, "low_freq_factor": _positive_number, "high_freq_factor": _positive_number,
               "original_max_positions": _size()}


def validate_fields(values: dict, rules: dict, where: str, names: dict | None = None) -> None:
    """Refuse the first value in ``values`` that breaks its rule, naming it as the user wrote it
    (``names`` maps a field to that, e.g. num_heads to num_attention_heads in config.json)."""
    names = names or {}
    for key, rule in rules.items():
        if key in values:
            wanted = rule(values[key])
            if wanted is not None:
                raise ConfigError(f"{where}: {names.get(key) or key} must be {wanted}, got {values[key]!r}")


def validate_model(values: dict, where: str, names: dict | None = None) -> None:
    """Every ModelConfig field flexoff uses, by type and range, then how the sizes fit together.

    ``values`` holds ModelConfig fields (0 for the sizes that default to another); ``where`` names
    the source (a config.json, or the config's name), ``names`` the fields as that source spells them.
    """
    names = names or {}
    validate_fields(values, _MODEL_RULES, where, names)

    def name(key: str) -> str:
        return names.get(key) or key

    def fail(message: str):
        raise ConfigError(f"{where}: {message}")

    heads, kv_heads = values["num_heads"], values.get("num_kv_heads") or values["num_heads"]
    if heads % kv_heads:
        fail(f"{name('num_heads')} ({heads}) must be a multiple of {name('num_kv_heads')} ({kv_heads})")
    head_dim, head_dim_name = values.get("head_dim") or 0, name("head_dim")
    if not head_dim:
        if values["hidden_size"] % heads:
            fail(f"{name('hidden_size')} ({values['hidden_size']}) must be a multiple of {name('num_heads')} ({heads})")
        head_dim, head_dim_name = values["hidden_size"] // heads, f"{name('hidden_size')} / {name('num_heads')}"
    if values.get("family") == "llama" and head_dim % 2:
        fail(f"{head_dim_name} must be even for rotary embeddings, got {head_dim}")
    vocab = values["vocab_size"]
    for key in ("bos_token_id", "pad_token_id", "eos_token_ids"):
        value = values.get(key)
        bad = [t for t in (value if isinstance(value, tuple) else (value,)) if t is not None and t >= vocab]
        if bad:
            fail(f"{name(key)} must be below {name('vocab_size')} ({vocab}), got {bad[0]}")


def validate_rope(values: dict, where: str, names: dict | None = None) -> None:
    """RopeScaling fields (as a dict) by type and range, as :func:`validate_model` checks the model's."""
    names = names or {}
    validate_fields(values, _ROPE_RULES, where, names)
    if values["kind"] == "llama3" and not values["high_freq_factor"] > values["low_freq_factor"]:
        # The llama3 frequency ramp divides by their difference.
        high, low = (names.get(key) or key for key in ("high_freq_factor", "low_freq_factor"))
        raise ConfigError(f"{where}: {high} ({values['high_freq_factor']}) must exceed "
                          f"{low} ({values['low_freq_factor']})")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as real checkpoints declare it: none, linear, or Llama-3 style."""

    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self):
        validate_rope(dataclasses.asdict(self), "RoPE scaling")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the layer math and the planner need to know about one model.

    ``family`` picks the layer file (``opt`` or ``llama``); the other fields are sizes and the
    switches real checkpoints of that family carry.
    """

    name: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    num_kv_heads: int = 0  # 0 means "same as num_heads"
    head_dim: int = 0  # 0 means hidden_size // num_heads
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # OPT
    word_embed_proj_dim: int = 0  # 0 means hidden_size
    do_layer_norm_before: bool = True
    remove_final_layer_norm: bool = False
    enable_bias: bool = True
    # Llama family
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False  # Qwen2 puts a bias on q, k and v
    qk_norm: bool = False  # Qwen3 RMS-normalises each head's queries and keys before RoPE

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UnsupportedModelError(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")
        validate_model({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, f"model {self.name!r}")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.word_embed_proj_dim == 0:
            object.__setattr__(self, "word_embed_proj_dim", self.hidden_size)

    # Sizes the planner and the runtime share, in elements (not bytes).
    @property
    def kv_elements_per_token_per_layer(self) -> int:
        """Keys plus values of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _opt(name, hidden, layers, heads, ffn, **extra) -> ModelConfig:
    return ModelConfig(
        name=name, family="opt", vocab_size=50272, hidden_size=hidden, num_layers=layers,
        num_heads=heads, intermediate_size=ffn, max_positions=2048, bos_token_id=2,
        eos_token_ids=(2,), pad_token_id=1, **extra,
    )


def _llama(name, hidden, layers, heads, kv_heads, ffn, vocab, max_pos, theta, **extra) -> ModelConfig:
    extra.setdefault("bos_token_id", 1)
    extra.setdefault("eos_token_ids", (2,))
    return ModelConfig(
        name=name, family="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, intermediate_size=ffn, max_positions=max_pos,
        rope_theta=theta, tie_word_embeddings=False, **extra,
    )


_LLAMA3_ROPE = RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_positions=8192)
_QWEN3 = dict(head_dim=128, norm_eps=1e-6, qk_norm=True, bos_token_id=151643, eos_token_ids=(151645,))

REGISTRY: dict[str, ModelConfig] = {
    cfg.name: cfg
    for cfg in (
        _opt("opt-125m", 768, 12, 12, 3072),
        _opt("opt-350m", 1024, 24, 16, 4096, word_embed_proj_dim=512, do_layer_norm_before=False),
        _opt("opt-1.3b", 2048, 24, 32, 8192),
        _opt("opt-2.7b", 2560, 32, 32, 10240),
        _opt("opt-6.7b", 4096, 32, 32, 16384),
        _opt("opt-13b", 5120, 40, 40, 20480),
        _opt("opt-30b", 7168, 48, 56, 28672),
        _opt("opt-66b", 9216, 64, 72, 36864),
        _opt("opt-175b", 12288, 96, 96, 49152),
        _llama("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, 4096, 10000.0),
        _llama("llama-2-13b", 5120, 40, 40, 40, 13824, 32000, 4096, 10000.0),
        _llama("llama-2-70b", 8192, 80, 64, 8, 28672, 32000, 4096, 10000.0),
        _llama("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, 8192, 500000.0,
               bos_token_id=128000, eos_token_ids=(128001,)),
        _llama("llama-3-70b", 8192, 80, 64, 8, 28672, 128256, 8192, 500000.0,
               bos_token_id=128000, eos_token_ids=(128001,)),
        _llama("mistral-7b", 4096, 32, 32, 8, 14336, 32768, 32768, 1000000.0),
        _llama("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, 32768, 1000000.0, norm_eps=1e-6,
               attention_bias=True, bos_token_id=None, eos_token_ids=(151643,)),
        _llama("qwen3-8b", 4096, 36, 32, 8, 12288, 151936, 40960, 1000000.0, **_QWEN3),
        _llama("qwen3-32b", 5120, 64, 64, 8, 25600, 151936, 40960, 1000000.0, **_QWEN3),
    )
}
# Llama 3.1 keeps the Llama 3 sizes and adds frequency scaling; named so users can plan for it.
REGISTRY["llama-3.1-8b"] = REGISTRY["llama-3-8b"].replace(
    name="llama-3.1-8b", max_positions=131072, rope_scaling=_LLAMA3_ROPE)
REGISTRY["llama-3.1-70b"] = REGISTRY["llama-3-70b"].replace(
    name="llama-3.1-70b", max_positions=131072, rope_scaling=_LLAMA3_ROPE)


def known_model_names() -> list[str]:
    return list(REGISTRY)


def resolve_model_config(name_or_dir: str) -> ModelConfig:
    """The configuration alone (of a Hub id, only its config.json is fetched)."""
    return resolve_model(name_or_dir, dummy=True)[0]


def resolve_model(model: str | Path, dummy: bool = False) -> tuple[ModelConfig, Path | None]:
    """A model argument as (config, checkpoint directory): a local directory, a registry name
    (case-insensitive; no directory, so it needs ``dummy``), or a Hugging Face Hub id ``org/name``,
    taken from the local Hub cache or downloaded (only its config.json when ``dummy``)."""
    name = str(model)
    directory = model_directory(name, "config" if dummy else "weights")
    if directory is None:
        if not dummy:
            example = f"facebook/{name.lower()}" if name.lower().startswith("opt-") else "facebook/opt-125m"
            raise UnknownModelError(
                f"{name!r} is a registry size with no checkpoint: use dummy weights (--dummy, or dummy=True in "
                f"Python), a local checkpoint directory, or a Hugging Face Hub id such as {example}"
            )
        return REGISTRY[name.lower()], None
    config = config_from_dir(directory)
    if directory != Path(name):  # a Hub snapshot: named as the user named it, not by its commit hash
        config = config.replace(name=name)
    return config, directory


def model_directory(model: str | Path, need: str = "weights") -> Path | None:
    """The local directory holding ``model``'s files, None for a registry name. Local directories
    and registry names win over Hub ids; ``need`` ("config", "tokenizer" or "weights") is what a
    Hub snapshot must hold (see flexoff.hub)."""
    name = str(model)
    if not name.strip():
        raise UnknownModelError("the model name is empty")
    path = Path(name)
    if path.is_dir():
        return path
    if name.lower() in REGISTRY:
        return None
    if is_hub_id(name):
        return hub_checkpoint(name, need)
    raise UnknownModelError(
        f"unknown model {name!r}: not a checkpoint directory, a Hugging Face Hub id (org/name), or one of: "
        + ", ".join(known_model_names())
    )


_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
    naming the file and the field of any value out of type or range."""
    path = Path(path)
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
    validate_model(values, where, names)
    for key in ("norm_eps", "rope_theta"):
        if key in values:
            values[key] = float(values[key])
    return ModelConfig(name=path.name, **values)


def _read_keys(raw: dict, keys: dict) -> tuple[dict, dict]:
    """(ModelConfig values as config.json gives them, the config.json name of each)."""
    values, names = {}, {}
    for name, (key, default) in keys.items():
        if key not in raw and default is _REQUIRED:
            raise KeyError(key)
        value = raw.get(key)
        values[name] = default if value is None and default is not _REQUIRED else value
        names[name] = key
    values["eos_token_ids"] = _eos_tuple(values["eos_token_ids"])
    if _is_int(values["pad_token_id"]) and values["pad_token_id"] < 0:
        values["pad_token_id"] = None  # some exports write -1 for "no padding token"
    return values, names


def _eos_tuple(value):
    """config.json's eos_token_id (one id, a list, or null) as a tuple; any other value is passed on
    for validation to refuse."""
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(value)
    return (value,) if _is_int(value) else value


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
    switches = {"mlp_bias": raw.get("mlp_bias", False),
                "use_sliding_window": raw.get("use_sliding_window", model_type == "mistral"),
                "attention_bias": raw.get("attention_bias", model_type == "qwen2")}  # Qwen2 biases q, k and v
    switches = {key: value for key, value in switches.items() if value is not None}
    validate_fields(switches, dict.fromkeys(switches, _boolean), where)
    if switches.get("mlp_bias"):
        raise UnsupportedModelError(f"{where}: MLP biases are not supported")
    if model_type != "qwen2" and switches.get("attention_bias"):  # transformers then biases o_proj too
        raise UnsupportedModelError(f"{where}: attention_bias true is not supported for {model_type}")
    values, names = _read_keys(raw, _LLAMA_KEYS)
    values["attention_bias"] = switches.get("attention_bias", False)
    values["qk_norm"] = model_type == "qwen3"
    if model_type == "qwen3" and raw.get("head_dim") is None:
        values["head_dim"] = 128  # transformers' Qwen3 default, not hidden_size / num_attention_heads
    window = raw.get("sliding_window")
    if switches.get("use_sliding_window") and window is not None:
        validate_fields({"max_positions": values["max_positions"], "sliding_window": window},
                        {"max_positions": _size(), "sliding_window": _size()}, where, names)
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
