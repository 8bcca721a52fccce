"""Model configurations: a table of named sizes, and a reader for a checkpoint's ``config.json``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnknownModelError, UnsupportedModelError
from ..hub import hub_checkpoint, is_hub_id

FAMILIES = ("opt", "llama")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as real checkpoints declare it: none, linear, or Llama-3 style."""

    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


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

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UnsupportedModelError(f"unknown model family {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.word_embed_proj_dim == 0:
            object.__setattr__(self, "word_embed_proj_dim", self.hidden_size)
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.name}: {self.num_heads} attention heads are not a multiple of {self.num_kv_heads} KV heads"
            )

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


_LLAMA_TYPES = ("llama", "mistral", "qwen2")


def config_from_dir(path: str | Path) -> ModelConfig:
    """Read a Hugging Face ``config.json`` into a ModelConfig, refusing what we cannot run."""
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
    try:
        if model_type == "opt":
            return _opt_from_json(path.name, raw)
        if model_type in _LLAMA_TYPES:
            return _llama_from_json(path.name, raw)
    except KeyError as exc:
        raise UnsupportedModelError(f"{config_file} lacks the field {exc.args[0]!r}") from None
    raise UnsupportedModelError(
        f"{path}: model_type {model_type!r} is not supported; supported: opt, " + ", ".join(_LLAMA_TYPES)
    )


def _eos_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _opt_from_json(name: str, raw: dict) -> ModelConfig:
    activation = raw.get("activation_function", "relu")
    if activation != "relu":
        raise UnsupportedModelError(f"{name}: OPT activation {activation!r} is not supported (only relu)")
    return ModelConfig(
        name=name, family="opt", vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
        intermediate_size=raw["ffn_dim"], max_positions=raw["max_position_embeddings"],
        word_embed_proj_dim=raw.get("word_embed_proj_dim") or raw["hidden_size"],
        do_layer_norm_before=raw.get("do_layer_norm_before", True),
        remove_final_layer_norm=raw.get("_remove_final_layer_norm", False),
        enable_bias=raw.get("enable_bias", True),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos_tuple(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
    )


def _rope_parameters(raw: dict) -> dict:
    """RoPE settings from either layout: newer exports nest theta and scaling in rope_parameters."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return params


def _rope_from_json(name: str, raw: dict) -> RopeScaling:
    scaling = _rope_parameters(raw)
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return RopeScaling()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3", factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_positions=int(scaling["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(f"{name}: RoPE scaling {kind!r} is not supported (default, linear, llama3)")


def _llama_from_json(name: str, raw: dict) -> ModelConfig:
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModelError(f"{name}: activation {activation!r} is not supported (only silu)")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{name}: MLP biases are not supported")
    max_positions = raw["max_position_embeddings"]
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", raw["model_type"] == "mistral")
    if uses_window and window:
        # Within the window, sliding-window attention equals full attention.
        max_positions = min(max_positions, int(window))
    qwen = raw["model_type"] == "qwen2"
    return ModelConfig(
        name=name, family="llama", vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=raw.get("head_dim") or 0,
        intermediate_size=raw["intermediate_size"], max_positions=max_positions,
        norm_eps=raw.get("rms_norm_eps", 1e-6), tie_word_embeddings=raw.get("tie_word_embeddings", False),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos_tuple(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"), rope_theta=float(_rope_parameters(raw)["rope_theta"]),
        rope_scaling=_rope_from_json(name, raw),
        attention_bias=raw.get("attention_bias", qwen),
    )
