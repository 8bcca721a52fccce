"""Model configurations: the fields the layer math and the planner read, each validated by type and
range. The registry of named sizes is in ``registry``, the reader of a checkpoint's ``config.json``
in ``hf_config``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..errors import ConfigError, UnsupportedModelError
from ..policy import CompressionConfig

FAMILIES = ("opt", "llama")


# Checks of one field's value: each returns what the value must be, or None when it is fine.
_MAX_SIZE = 2**31 - 1  # no real dimension comes near; a larger one is a typo that would overflow shapes
_MAX_LAYERS = 10_000  # real models have a few hundred; each layer becomes a stage before any check of size
_MAX_EXPERTS = 4096  # real models have up to a few hundred; each expert is a row of a layer's tensors


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def size_rule(limit: int = _MAX_SIZE, minimum: int = 1):
    def check(value):
        if not is_int(value) or value < minimum:
            return "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        return f"at most {limit}" if value > limit else None
    return check


def _positive_number(value):
    # NaN, infinities and non-positive values (an epsilon of 0, a RoPE base of -1) make the model compute NaN.
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return None if ok else "a positive finite number"


def boolean_rule(value):
    return None if isinstance(value, bool) else "true or false"


def _optional_token(value):
    return None if value is None or (is_int(value) and value >= 0) else "a non-negative integer token id or null"


def _layer_indices(value):
    ok = isinstance(value, tuple) and all(is_int(i) and i >= 0 for i in value)
    return None if ok else "a list of non-negative layer indices"


def _tokens(value):
    ok = isinstance(value, tuple) and all(is_int(t) and t >= 0 for t in value)
    return None if ok else "a non-negative integer token id or a list of them"


_MODEL_RULES = {
    "vocab_size": size_rule(), "hidden_size": size_rule(), "num_layers": size_rule(_MAX_LAYERS), "num_heads": size_rule(),
    "intermediate_size": size_rule(), "max_positions": size_rule(),
    "num_kv_heads": size_rule(minimum=0), "head_dim": size_rule(minimum=0), "word_embed_proj_dim": size_rule(minimum=0),
    "norm_eps": _positive_number, "rope_theta": _positive_number,
    "tie_word_embeddings": boolean_rule, "do_layer_norm_before": boolean_rule, "remove_final_layer_norm": boolean_rule,
    "enable_bias": boolean_rule, "attention_bias": boolean_rule, "qk_norm": boolean_rule,
    "bos_token_id": _optional_token, "pad_token_id": _optional_token, "eos_token_ids": _tokens,
    "rope_scaling": lambda value: None if isinstance(value, RopeScaling) else "a RopeScaling",
    "num_experts": size_rule(_MAX_EXPERTS, minimum=0), "experts_per_token": size_rule(_MAX_EXPERTS, minimum=0),
    "expert_intermediate_size": size_rule(minimum=0), "shared_expert_intermediate_size": size_rule(minimum=0),
    "norm_topk_prob": boolean_rule, "dense_layers": _layer_indices,
    "native_dtype": lambda value: None if value in NATIVE_DTYPES else "one of " + ", ".join(NATIVE_DTYPES),
    "stored_compression": lambda value: None if value is None or isinstance(value, CompressionConfig)
    else "a CompressionConfig or null",
}
ROPE_KINDS = ("default", "linear", "llama3")
NATIVE_DTYPES = ("float16", "bfloat16")
_ROPE_RULES = {"kind": lambda value: None if value in ROPE_KINDS else "one of " + ", ".join(ROPE_KINDS),
               "factor": _positive_number, "low_freq_factor": _positive_number, "high_freq_factor": _positive_number,
               "original_max_positions": size_rule()}


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
    experts = values.get("num_experts") or 0
    if experts:
        if values.get("family") != "llama":
            fail(f"mixture-of-experts layers are supported in the llama family only, not {values.get('family')!r}")
        top_k = values.get("experts_per_token") or 0
        if not 1 <= top_k <= experts:
            fail(f"{name('experts_per_token')} must be between 1 and {name('num_experts')} ({experts}), got {top_k}")
        outside = [i for i in values.get("dense_layers", ()) if i >= values["num_layers"]]
        if outside:
            fail(f"{name('dense_layers')} names layer {outside[0]}, but the model has {values['num_layers']}")
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
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): 0 experts is a dense model. Each token's
    # MLP is the weighted sum of its top experts_per_token experts of the router's choice.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0  # 0 means intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated expert every token uses; 0: none
    norm_topk_prob: bool = True  # the chosen experts' probabilities are renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of a MoE model with a dense MLP (of intermediate_size)
    # The 16-bit format the model was trained and published in, which dtype "auto" runs on a GPU:
    # bfloat16 models may overflow fp16's range.
    native_dtype: str = "float16"
    # The group-wise format the checkpoint stores its matrices in (a GGUF's Q4_0/Q4_1 are 4 bits in
    # groups of 32), None for floating-point weights. A policy reads such weights as stored, so its
    # weight compression is this format (see planner.default.weights_as_stored).
    stored_compression: CompressionConfig | None = None

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
        if self.expert_intermediate_size == 0:
            object.__setattr__(self, "expert_intermediate_size", self.intermediate_size)

    def sparse_layer(self, index: int) -> bool:
        """Whether layer ``index`` routes its tokens to experts (otherwise its MLP is dense)."""
        return self.num_experts > 0 and index not in self.dense_layers

    # Sizes the planner and the runtime share, in elements (not bytes).
    @property
    def kv_elements_per_token_per_layer(self) -> int:
        """Keys plus values of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
