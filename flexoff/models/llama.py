"""Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, and the mixtures of experts Mixtral, Qwen2-MoE and
Qwen3-MoE): RoPE, RMSNorm, SwiGLU or routed experts, grouped-query attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import moe
from .common import Attend, WeightSpec, linear, spec
from .config import ModelConfig

_PREFIX = ("model.",)


def embed_specs(cfg: ModelConfig) -> list[WeightSpec]:
    return [spec("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), _PREFIX)]


def layer_specs(cfg: ModelConfig, index: int) -> list[WeightSpec]:
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    prefixes = (f"model.layers.{index}.",)
    specs = [
        spec("input_layernorm.weight", (h,), prefixes, "norm"),
        spec("self_attn.q_proj.weight", (q_dim, h), prefixes),
        spec("self_attn.k_proj.weight", (kv_dim, h), prefixes),
        spec("self_attn.v_proj.weight", (kv_dim, h), prefixes),
        spec("self_attn.o_proj.weight", (h, q_dim), prefixes),
        spec("post_attention_layernorm.weight", (h,), prefixes, "norm"),
    ]
    if cfg.sparse_layer(index):
        specs += moe.mlp_specs(cfg, index)
    else:
        specs += moe.swiglu_specs("mlp.", h, ffn, prefixes)
    if cfg.attention_bias:
        for name, size in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
            specs.append(spec(f"self_attn.{name}.bias", (size,), prefixes, "bias"))
    if cfg.qk_norm:
        specs += [spec(f"self_attn.{name}.weight", (cfg.head_dim,), prefixes, "norm") for name in ("q_norm", "k_norm")]
    return specs


def head_specs(cfg: ModelConfig) -> list[WeightSpec]:
    tied = ("model.embed_tokens.weight",) if cfg.tie_word_embeddings else ()
    return [
        spec("norm.weight", (cfg.hidden_size,), _PREFIX, "norm"),
        spec("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), ("",), extra_keys=tied),
    ]


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies (head_dim / 2,), fp32, with the config's scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = cfg.rope_scaling
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        # Long wavelengths are stretched by `factor`, short ones kept, and the band between blended.
        low_wavelen = scaling.original_max_positions / scaling.low_freq_factor
        high_wavelen = scaling.original_max_positions / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_positions / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


def step_context(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (batch, 1, seq, head_dim), shared by every layer of one step."""
    inv_freq = inverse_frequencies(cfg).to(positions.device)
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, head_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, the same sums, with half of x as the only temporary: a long
    prefill's rotation is its largest moment before attention. The result is contiguous whatever
    x's strides, so that attention folds a KV head's query heads into rows without a copy."""
    half = x.shape[-1] // 2
    out = torch.mul(x, cos, out=torch.empty(x.shape, dtype=x.dtype, device=x.device))
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out


def _rms_norm(cfg: ModelConfig, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Normalised in fp32, as the reference implementation does, so fp16 runs do not overflow; one
    # fp32 copy of x, scaled in place, is the only temporary the size of x.
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    x32 = x.to(torch.float32, copy=True)
    x32.mul_(torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(cfg.norm_eps)))
    return x32.to(x.dtype).mul_(weight)


def embed(cfg: ModelConfig, w: dict, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """input_ids: (batch, seq) -> hidden (batch, seq, hidden). Positions enter through RoPE."""
    return F.embedding(input_ids, w["embed_tokens.weight"])


def attention_inputs(cfg: ModelConfig, w: dict, hidden: torch.Tensor, context):
    """The layer up to attention: hidden (batch, seq, hidden) -> q (batch, heads, seq, head_dim) and
    k, v (batch, kv_heads, seq, head_dim), rotated."""
    cos, sin = context
    batch, seq, _ = hidden.shape
    x = _rms_norm(cfg, hidden, w["input_layernorm.weight"])
    q, k, v = (linear(x, w[f"self_attn.{name}.weight"], w.get(f"self_attn.{name}.bias"))
               .view(batch, seq, heads, cfg.head_dim).transpose(1, 2)
               for name, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads), ("v_proj", cfg.num_kv_heads)))
    del x  # freed before the rotations, a long prefill's largest moment here
    if cfg.qk_norm:  # over each head's head_dim, before the rotation
        q = _rms_norm(cfg, q, w["self_attn.q_norm.weight"])
        k = _rms_norm(cfg, k, w["self_attn.k_norm.weight"])
    q = _rotate(q, cos, sin)
    return q, _rotate(k, cos, sin), v


def after_attention(cfg: ModelConfig, w: dict, hidden: torch.Tensor, attn: torch.Tensor,
                    fetch: moe.ExpertFetch | None = None) -> torch.Tensor:
    """The layer from attention on: the layer's input hidden and attention's output -> its output
    hidden. ``fetch``: where a sparse layer's experts load once it has routed, if they do."""
    batch, seq, _ = hidden.shape
    attn = attn.transpose(1, 2).reshape(batch, seq, cfg.num_heads * cfg.head_dim)
    hidden = hidden + linear(attn, w["self_attn.o_proj.weight"])

    x = _rms_norm(cfg, hidden, w["post_attention_layernorm.weight"])
    sparse = moe.ROUTER in w  # the layer's specs say which MLP it has
    return hidden + (moe.sparse_mlp(cfg, w, x, fetch) if sparse else moe.swiglu(w, x, "mlp."))


def layer(cfg: ModelConfig, w: dict, hidden: torch.Tensor, context, attend: Attend,
          fetch: moe.ExpertFetch | None = None) -> torch.Tensor:
    """One decoder layer: (batch, seq, hidden) -> (batch, seq, hidden)."""
    return after_attention(cfg, w, hidden, attend(*attention_inputs(cfg, w, hidden, context)), fetch)


def head(cfg: ModelConfig, w: dict, hidden: torch.Tensor) -> torch.Tensor:
    """(batch, seq, hidden) -> logits (batch, seq, vocab)."""
    return linear(_rms_norm(cfg, hidden, w["norm.weight"]), w["lm_head.weight"])
