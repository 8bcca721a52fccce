"""Tiny GGUF files written as llama.cpp's converter writes them, from a tiny random Hugging Face
model the test builds: q and k rows permuted, norms in F32, the matrices in one chosen type, and a
byte-level BPE tokenizer (trained here on the tests' words) in the metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.conftest import PROMPTS, WORDS

MATRIX_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
SPECIALS = ("<pad>", "<s>", "</s>")
THETA = 10000.0
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}" \
           "{% if add_generation_prompt %}<s>assistant{% endif %}"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]) \
        .swapaxes(1, 2).reshape(weights.shape)


def bpe_tokenizer():
    """(tokens, merges) of a byte-level BPE over the tests' words, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator([" ".join(WORDS), *PROMPTS] * 4, trainer)
    vocab = raw.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    import json

    merges = [" ".join(pair) if isinstance(pair, list) else pair
              for pair in json.loads(raw.to_str())["model"]["merges"]]
    return tokens, merges


def tiny_llama(vocab: int, seed: int = 0, tied: bool = False, rope_scaling: dict | None = None):
    """A random LlamaForCausalLM whose widths are multiples of ggml's 32-value blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied, rms_norm_eps=1e-6,
                         rope_theta=THETA, rope_scaling=rope_scaling)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger-than-default weights make greedy choices decisive, not near-ties
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model.eval()


def tiny_qwen(arch: str, vocab: int, seed: int = 0):
    """A random Qwen2 (biased q, k, v) or Qwen3 (q/k norms, heads 32 wide: not hidden / heads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=THETA)
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if arch == "qwen2" else \
        Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model.eval()


def llama3_rope_factors(head_dim: int, factor: float, original: int, low: float = 1.0, high: float = 4.0):
    """``rope_freqs.weight`` as llama.cpp's convert_hf_to_gguf.py LlamaModel computes it."""
    import math

    freqs = 1.0 / (THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_tensors(model, arch: str = "llama") -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, q and k permuted as its converter does for llama."""
    cfg = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for i in range(cfg.num_hidden_layers):
        for hf, name in names.items():
            for part in ("weight", "bias"):
                value = state.get(f"model.layers.{i}.{hf}.{part}")
                if value is None:
                    continue
                if arch == "llama" and name == "attn_q":
                    value = permute(value, cfg.num_attention_heads)
                elif arch == "llama" and name == "attn_k":
                    value = permute(value, cfg.num_key_value_heads)
                out[f"blk.{i}.{name}.{part}"] = value
    return out


def write_gguf(path: Path, model, matrix_type: str = "F32", *, arch: str = "llama", metadata=None,
               tensors: dict[str, np.ndarray] | None = None, types: dict[str, str] | None = None) -> Path:
    """``model`` as a GGUF file at ``path``: 1-D tensors in F32, the others in ``matrix_type``
    (``types`` overrides a tensor's). ``metadata`` (key -> value or None) replaces or drops keys."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tokens, merges = bpe_tokenizer()
    writer = gguf.GGUFWriter(str(path), arch)
    keys = {
        f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.freq_base": THETA, f"{arch}.rope.dimension_count": head_dim,
        f"{arch}.attention.key_length": head_dim if arch == "qwen3" else None,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.chat_template": TEMPLATE,
    }
    keys.update(metadata or {})
    for key, value in keys.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, value in (tensors if tensors is not None else gguf_tensors(model, arch)).items():
        kind = (types or {}).get(name, "F32" if value.ndim == 1 else matrix_type)
        stored = value if value.dtype.kind == "i" else gguf.quants.quantize(value.astype(np.float32), Q[kind])
        writer.add_tensor(name, stored, raw_dtype=Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
