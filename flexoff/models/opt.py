"""OPT: learned positions (offset 2), pre- or post-LayerNorm, ReLU MLP, optional project_in/out."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import Attend, WeightSpec, linear, spec
from .config import ModelConfig
from .moe import ExpertFetch

POSITION_OFFSET = 2  # OPT reserves the first two rows of its position table
_PREFIXES = ("model.decoder.", "decoder.")


def embed_specs(cfg: ModelConfig) -> list[WeightSpec]:
    h, e = cfg.hidden_size, cfg.word_embed_proj_dim
    specs = [
        spec("embed_tokens.weight", (cfg.vocab_size, e), _PREFIXES),
        spec("embed_positions.weight", (cfg.max_positions + POSITION_OFFSET, h), _PREFIXES),
    ]
    if e != h:
        specs.append(spec("project_in.weight", (h, e), _PREFIXES))
    return specs


def layer_specs(cfg: ModelConfig, index: int) -> list[WeightSpec]:
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    prefixes = tuple(f"{p}layers.{index}." for p in _PREFIXES)
    specs = []
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        specs.append(spec(f"self_attn.{proj}.weight", (h, h), prefixes))
        if cfg.enable_bias:
            specs.append(spec(f"self_attn.{proj}.bias", (h,), prefixes, "bias"))
    for norm in ("self_attn_layer_norm", "final_layer_norm"):
        specs.append(spec(f"{norm}.weight", (h,), prefixes, "norm"))
        specs.append(spec(f"{norm}.bias", (h,), prefixes, "bias"))
    specs.append(spec("fc1.weight", (ffn, h), prefixes))
    specs.append(spec("fc2.weight", (h, ffn), prefixes))
    if cfg.enable_bias:
        specs.append(spec("fc1.bias", (ffn,), prefixes, "bias"))
        specs.append(spec("fc2.bias", (h,), prefixes, "bias"))
    return specs


def has_final_norm(cfg: ModelConfig) -> bool:
    return cfg.do_layer_norm_before and not cfg.remove_final_layer_norm


def head_specs(cfg: ModelConfig) -> list[WeightSpec]:
    h, e = cfg.hidden_size, cfg.word_embed_proj_dim
    specs = []
    if has_final_norm(cfg):
        specs.append(spec("final_layer_norm.weight", (h,), _PREFIXES, "norm"))
        specs.append(spec("final_layer_norm.bias", (h,), _PREFIXES, "bias"))
    if e != h:
        specs.append(spec("project_out.weight", (e, h), _PREFIXES))
    tied = tuple(p + "embed_tokens.weight" for p in _PREFIXES) if cfg.tie_word_embeddings else ()
    specs.append(spec("lm_head.weight", (cfg.vocab_size, e), ("",), extra_keys=tied))
    return specs


def step_context(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> None:
    """OPT needs nothing per step beyond the positions the embedding uses."""
    return None


def embed(cfg: ModelConfig, w: dict, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """input_ids, positions: (batch, seq) -> hidden (batch, seq, hidden)."""
    hidden = F.embedding(input_ids, w["embed_tokens.weight"])
    if "project_in.weight" in w:
        hidden = linear(hidden, w["project_in.weight"])
    return hidden + F.embedding(positions + POSITION_OFFSET, w["embed_positions.weight"])


def _layer_norm(cfg: ModelConfig, x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w[f"{name}.weight"], w[f"{name}.bias"], cfg.norm_eps)


def attention_inputs(cfg: ModelConfig, w: dict, hidden: torch.Tensor, context):
    """The layer up to attention: hidden (batch, seq, hidden) -> q, k, v (batch, heads, seq, head_dim)."""
    batch, seq, _ = hidden.shape
    x = _layer_norm(cfg, hidden, w, "self_attn_layer_norm") if cfg.do_layer_norm_before else hidden

    def project(name: str) -> torch.Tensor:
        out = linear(x, w[f"self_attn.{name}.weight"], w.get(f"self_attn.{name}.bias"))
        return out.view(batch, seq, cfg.num_heads, cfg.head_dim).transpose(1, 2)

    return project("q_proj"), project("k_proj"), project("v_proj")


def after_attention(cfg: ModelConfig, w: dict, hidden: torch.Tensor, attn: torch.Tensor,
                    fetch: ExpertFetch | None = None) -> torch.Tensor:
    """The layer from attention on: the layer's input hidden and attention's output -> its output
    hidden. ``fetch`` goes unused: OPT's MLP has no experts."""
    batch, seq, _ = hidden.shape
    pre_norm = cfg.do_layer_norm_before
    attn = attn.transpose(1, 2).reshape(batch, seq, cfg.num_heads * cfg.head_dim)
    hidden = hidden + linear(attn, w["self_attn.out_proj.weight"], w.get("self_attn.out_proj.bias"))
    if not pre_norm:
        hidden = _layer_norm(cfg, hidden, w, "self_attn_layer_norm")

    residual = hidden
    x = _layer_norm(cfg, hidden, w, "final_layer_norm") if pre_norm else hidden
    x = linear(F.relu(linear(x, w["fc1.weight"], w.get("fc1.bias"))), w["fc2.weight"], w.get("fc2.bias"))
    hidden = residual + x
    if not pre_norm:
        hidden = _layer_norm(cfg, hidden, w, "final_layer_norm")
    return hidden


def layer(cfg: ModelConfig, w: dict, hidden: torch.Tensor, context, attend: Attend,
          fetch: ExpertFetch | None = None) -> torch.Tensor:
    """One decoder layer: (batch, seq, hidden) -> (batch, seq, hidden)."""
    return after_attention(cfg, w, hidden, attend(*attention_inputs(cfg, w, hidden, context)))


def head(cfg: ModelConfig, w: dict, hidden: torch.Tensor) -> torch.Tensor:
    """(batch, seq, hidden) -> logits (batch, seq, vocab)."""
    if has_final_norm(cfg):
        hidden = _layer_norm(cfg, hidden, w, "final_layer_norm")
    if "project_out.weight" in w:
        hidden = linear(hidden, w["project_out.weight"])
    return linear(hidden, w["lm_head.weight"])
