"""A GGUF file's metadata as a ModelConfig: the keys llama.cpp writes for the Llama family (its
``llama``, ``qwen2`` and ``qwen3`` architectures), each validated and named by its key, and checked
against the tensors' shapes. The file format itself is read by ``flexoff.gguf_format``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, ConfigError, UnsupportedModelError
from ..gguf_format import GGUFFile
from ..policy import CompressionConfig
from .config import ModelConfig, RopeScaling, is_int, validate_model, validate_rope
from .llama import inverse_frequencies

SUFFIX = ".gguf"
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's per-frequency RoPE factors, which llama.cpp stores as a tensor
ARCHITECTURES = ("llama", "qwen2", "qwen3")
# llama.cpp's converter permutes the rows of q and k of these (for its rotary layout); see
# weights/gguf.py, which undoes it.
PERMUTED = ("llama",)
_REQUIRED = object()

# ModelConfig field -> (its key under the architecture's prefix, its default when absent).
_KEYS = {
    "hidden_size": ("embedding_length", _REQUIRED), "num_layers": ("block_count", _REQUIRED),
    "num_heads": ("attention.head_count", _REQUIRED), "num_kv_heads": ("attention.head_count_kv", 0),
    "intermediate_size": ("feed_forward_length", _REQUIRED), "max_positions": ("context_length", _REQUIRED),
    "norm_eps": ("attention.layer_norm_rms_epsilon", _REQUIRED), "rope_theta": ("rope.freq_base", 10000.0),
}
_TOKEN_KEYS = {"bos_token_id": "tokenizer.ggml.bos_token_id", "pad_token_id": "tokenizer.ggml.padding_token_id"}
# Ids that end a generation: llama.cpp stops at the end-of-turn and end-of-message tokens too.
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_path(path: str | Path) -> Path | None:
    """The GGUF file a model path names: the path itself if it is a ``.gguf`` file, else the one
    ``.gguf`` file of a directory without a config.json; None for anything else."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise UnsupportedModelError(f"{path} holds several GGUF files ({names}); give the one to load as --model")
    return found[0] if found else None


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file opened: its reader, its config, and the metadata key behind each config field."""

    file: GGUFFile
    config: ModelConfig
    architecture: str
    names: dict[str, str]

    @property
    def permuted(self) -> bool:
        return self.architecture in PERMUTED


def read_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file and read its config, refusing what flexoff cannot run by name."""
    file = GGUFFile(path)
    try:
        config, architecture, names = _config(file)
    except BaseException:
        file.close()
        raise
    return GGUFModel(file, config, architecture, names)


def config_from_gguf(path: str | Path) -> ModelConfig:
    model = read_gguf(path)
    model.file.close()
    return model.config


def _config(file: GGUFFile) -> tuple[ModelConfig, str, dict[str, str]]:
    meta, where = file.metadata, str(file.path)
    architecture = meta.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise UnsupportedModelError(f"{where}: general.architecture {architecture!r} is not supported; "
                                    f"supported: {', '.join(ARCHITECTURES)}")
    prefix = architecture + "."
    experts = meta.get(prefix + "expert_count", 0)
    if experts:
        raise UnsupportedModelError(f"{where}: {prefix}expert_count is {experts!r}: mixture-of-experts GGUF "
                                    "files are not supported")
    values, names = {}, {}
    for field, (key, default) in _KEYS.items():
        names[field] = prefix + key
        if prefix + key not in meta and default is _REQUIRED:
            raise UnsupportedModelError(f"{where} lacks the metadata key {prefix + key!r}")
        values[field] = meta.get(prefix + key, default)
    values["vocab_size"], names["vocab_size"] = _vocab(meta, prefix, where)
    values.update(_head_dim(meta, prefix, names, values, where))
    for field, key in _TOKEN_KEYS.items():
        values[field], names[field] = meta.get(key), key
    eos = [meta[key] for key in _EOS_KEYS if key in meta]
    values["eos_token_ids"] = tuple(dict.fromkeys(eos)) if all(is_int(i) for i in eos) else eos
    names["eos_token_ids"] = next((key for key in _EOS_KEYS if key in meta), _EOS_KEYS[0])
    tensors = file.tensors
    values["tie_word_embeddings"] = "output.weight" not in tensors
    values["attention_bias"] = "blk.0.attn_q.bias" in tensors
    values["qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    if "blk.0.attn_output.bias" in tensors or (values["attention_bias"] and architecture != "qwen2"):
        raise UnsupportedModelError(f"{where}: attention biases are supported for qwen2 only (on q, k and v)")
    validate_model({"family": "llama", **values}, where, names)
    values["rope_scaling"] = _rope_scaling(meta, prefix, where)
    if ROPE_FREQS in tensors:
        values["rope_scaling"] = _llama3_scaling(file, prefix, values)
    values["rope_theta"], values["norm_eps"] = float(values["rope_theta"]), float(values["norm_eps"])
    values["stored_compression"], values["native_dtype"] = _stored_format(file)
    config = ModelConfig(name=file.path.stem, family="llama", **values)
    _check_embedding(file, config, names)
    return config, architecture, names


def _vocab(meta: dict, prefix: str, where: str) -> tuple[object, str]:
    """As transformers reads it: the architecture's vocab_size, else the tokenizer's token count."""
    if prefix + "vocab_size" in meta:
        return meta[prefix + "vocab_size"], prefix + "vocab_size"
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        raise UnsupportedModelError(f"{where} has neither {prefix}vocab_size nor tokenizer.ggml.tokens")
    return len(tokens), "tokenizer.ggml.tokens"


def _head_dim(meta: dict, prefix: str, names: dict, values: dict, where: str) -> dict:
    """head_dim from the key length (Qwen3 sets it apart from the width), else the rotary dimension;
    rotary embeddings over part of a head are not supported."""
    key_length, value_length = meta.get(prefix + "attention.key_length"), meta.get(prefix + "attention.value_length")
    rotary = meta.get(prefix + "rope.dimension_count")
    head_dim, names["head_dim"] = (key_length, prefix + "attention.key_length") if key_length is not None else \
        (rotary, prefix + "rope.dimension_count") if rotary is not None else (0, prefix + "attention.key_length")
    if value_length is not None and value_length != head_dim:
        raise UnsupportedModelError(f"{where}: {prefix}attention.value_length ({value_length!r}) differs from "
                                    f"{names['head_dim']} ({head_dim!r})")
    if rotary is not None and key_length is not None and rotary != key_length:
        raise UnsupportedModelError(f"{where}: {prefix}rope.dimension_count ({rotary!r}) differs from "
                                    f"{prefix}attention.key_length ({key_length!r}): partial rotary embeddings "
                                    "are not supported")
    return {"head_dim": head_dim}


def _rope_scaling(meta: dict, prefix: str, where: str) -> RopeScaling:
    kind = meta.get(prefix + "rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind != "linear":
        raise UnsupportedModelError(f"{where}: {prefix}rope.scaling.type {kind!r} is not supported (none, linear)")
    factor = meta.get(prefix + "rope.scaling.factor")
    validate_rope({"kind": "linear", "factor": factor}, where, {"factor": prefix + "rope.scaling.factor"})
    return RopeScaling(kind="linear", factor=float(factor))


def _llama3_scaling(file: GGUFFile, prefix: str, values: dict) -> RopeScaling:
    """The Llama 3 scaling whose factors ``rope_freqs.weight`` holds. llama.cpp's converter computes
    them with low and high frequency factors 1 and 4 and an original context of 8192 (or the
    metadata's); the largest factor is the scaling factor. Other factors are refused."""
    info = file.tensors[ROPE_FREQS]
    head_dim = values["head_dim"] or values["hidden_size"] // values["num_heads"]
    if info.type_name != "F32" or info.shape != (head_dim // 2,):
        raise UnsupportedModelError(f"{file.path}: {ROPE_FREQS} must be F32 of shape [{head_dim // 2}], got "
                                    f"{info.type_name} {list(info.shape)}")
    factors = np.frombuffer(file.raw(ROPE_FREQS).tobytes(), dtype="<f4").astype(np.float64)
    original = file.metadata.get(prefix + "rope.scaling.original_context_length", 8192)
    fields = {"kind": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_positions": original}
    validate_rope(fields, str(file.path), {"factor": ROPE_FREQS,
                                           "original_max_positions": prefix + "rope.scaling.original_context_length"})
    scaling = RopeScaling(**fields)
    # inverse_frequencies reads a config: one head of head_dim.
    config = ModelConfig(name="rope", family="llama", vocab_size=1, hidden_size=head_dim, num_layers=1, num_heads=1,
                         intermediate_size=1, max_positions=1, rope_theta=float(values["rope_theta"]),
                         rope_scaling=scaling)
    plain = inverse_frequencies(config.replace(rope_scaling=RopeScaling())).double().numpy()
    expected = plain / inverse_frequencies(config).double().numpy()
    if not np.allclose(factors, expected, rtol=1e-5, atol=0):
        raise UnsupportedModelError(f"{file.path}: {ROPE_FREQS} holds RoPE factors that are not Llama 3's "
                                    "(factor, low 1, high 4); flexoff cannot run them")
    return scaling


def _stored_format(file: GGUFFile) -> tuple[CompressionConfig | None, str]:
    """The format most of the decoder layers' matrix elements are stored in (see
    ModelConfig.stored_compression), and the 16-bit dtype the model runs in on a GPU by default."""
    counts: dict[str, int] = {}
    for info in file.tensors.values():
        if info.name.startswith("blk.") and len(info.shape) == 2:
            counts[info.type_name] = counts.get(info.type_name, 0) + info.numel
    total = sum(counts.values())

    def mostly(*types: str) -> bool:
        return 2 * sum(counts.get(t, 0) for t in types) > total

    stored = CompressionConfig(4, 32) if mostly("Q4_0", "Q4_1") else CompressionConfig(8, 32) if mostly("Q8_0") \
        else None
    return stored, "bfloat16" if mostly("BF16") else "float16"


def _check_embedding(file: GGUFFile, config: ModelConfig, names: dict) -> None:
    """The metadata's sizes against the embedding's shape, naming both (the layers' tensors are
    checked when the weights are)."""
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None:
        raise CheckpointError(f"{file.path}: tensor 'token_embd.weight' is not in the file")
    expected = (config.vocab_size, config.hidden_size)
    if embedding.shape != expected:
        raise ConfigError(f"{file.path}: token_embd.weight has shape {list(embedding.shape)} but "
                          f"{names['vocab_size']}={config.vocab_size} and {names['hidden_size']}={config.hidden_size} "
                          f"need {list(expected)}")
