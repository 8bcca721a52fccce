"""The registry of named model sizes (dummy weights need no download), and the resolution of a model
argument to its configuration and checkpoint directory."""

from __future__ import annotations

from pathlib import Path

from ..errors import UnknownModelError
from ..hub import hub_checkpoint, is_hub_id
from .config import ModelConfig, RopeScaling
from .gguf_config import gguf_path
from .hf_config import config_from_dir


def _opt(name, hidden, layers, heads, ffn, **extra) -> ModelConfig:
    return ModelConfig(
        name=name, family="opt", vocab_size=50272, hidden_size=hidden, num_layers=layers,
        num_heads=heads, intermediate_size=ffn, max_positions=2048, bos_token_id=2,
        eos_token_ids=(2,), pad_token_id=1, **extra,
    )


def _llama(name, hidden, layers, heads, kv_heads, ffn, vocab, max_pos, theta, **extra) -> ModelConfig:
    extra.setdefault("bos_token_id", 1)
    extra.setdefault("eos_token_ids", (2,))
    extra.setdefault("native_dtype", "bfloat16")  # all but Llama 2 are published in bfloat16
    return ModelConfig(
        name=name, family="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, intermediate_size=ffn, max_positions=max_pos,
        rope_theta=theta, tie_word_embeddings=False, **extra,
    )


_LLAMA3_ROPE = RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_positions=8192)
_QWEN3 = dict(head_dim=128, norm_eps=1e-6, qk_norm=True, bos_token_id=151643, eos_token_ids=(151645,))
_QWEN2_MOE = dict(norm_eps=1e-6, attention_bias=True, norm_topk_prob=False, bos_token_id=151643,
                  eos_token_ids=(151643,))

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
        _llama("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, 4096, 10000.0, native_dtype="float16"),
        _llama("llama-2-13b", 5120, 40, 40, 40, 13824, 32000, 4096, 10000.0, native_dtype="float16"),
        _llama("llama-2-70b", 8192, 80, 64, 8, 28672, 32000, 4096, 10000.0, native_dtype="float16"),
        _llama("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, 8192, 500000.0,
               bos_token_id=128000, eos_token_ids=(128001,)),
        _llama("llama-3-70b", 8192, 80, 64, 8, 28672, 128256, 8192, 500000.0,
               bos_token_id=128000, eos_token_ids=(128001,)),
        _llama("mistral-7b", 4096, 32, 32, 8, 14336, 32768, 32768, 1000000.0),
        _llama("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, 32768, 1000000.0, norm_eps=1e-6,
               attention_bias=True, bos_token_id=None, eos_token_ids=(151643,)),
        _llama("qwen3-8b", 4096, 36, 32, 8, 12288, 151936, 40960, 1000000.0, **_QWEN3),
        _llama("qwen3-32b", 5120, 64, 64, 8, 25600, 151936, 40960, 1000000.0, **_QWEN3),
        # Mixtures of experts: for Qwen, intermediate_size is the dense MLP's, the experts' is apart.
        _llama("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, 32768, 1000000.0, num_experts=8,
               experts_per_token=2),
        _llama("mixtral-8x22b", 6144, 56, 48, 8, 16384, 32768, 65536, 1000000.0, num_experts=8,
               experts_per_token=2),
        _llama("qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 151936, 40960, 1000000.0, num_experts=128,
               experts_per_token=8, expert_intermediate_size=768, **_QWEN3),
        _llama("qwen3-235b-a22b", 4096, 94, 64, 4, 12288, 151936, 40960, 1000000.0, num_experts=128,
               experts_per_token=8, expert_intermediate_size=1536, **_QWEN3),
        _llama("qwen1.5-moe-a2.7b", 2048, 24, 16, 16, 5632, 151936, 8192, 1000000.0, num_experts=60,
               experts_per_token=4, expert_intermediate_size=1408, shared_expert_intermediate_size=5632,
               **_QWEN2_MOE),
        _llama("qwen2-57b-a14b", 3584, 28, 28, 4, 18944, 151936, 32768, 1000000.0, num_experts=64,
               experts_per_token=8, expert_intermediate_size=2560, shared_expert_intermediate_size=20480,
               **_QWEN2_MOE),
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
    """A model argument as (config, checkpoint directory or GGUF file): a local directory or .gguf
    file, a registry name (case-insensitive; no directory, so it needs ``dummy``), or a Hugging Face Hub id ``org/name``,
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
    """The local directory holding ``model``'s files (or the GGUF file it names), None for a
    registry name. Local paths and registry names win over Hub ids; ``need`` ("config",
    "tokenizer" or "weights") is what a Hub snapshot must hold (see flexoff.hub)."""
    name = str(model)
    if not name.strip():
        raise UnknownModelError("the model name is empty")
    path = Path(name)
    if path.is_dir() or gguf_path(path) is not None:
        return path
    if name.lower() in REGISTRY:
        return None
    if is_hub_id(name):
        return hub_checkpoint(name, need)
    raise UnknownModelError(
        f"unknown model {name!r}: not a checkpoint directory, a .gguf file, a Hugging Face Hub id (org/name), "
        "or one of: "
        + ", ".join(known_model_names())
    )
