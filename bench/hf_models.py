"""A flexoff ModelConfig as the transformers model of the same architecture: its config class, filled
field by field, and its causal-LM class, so that HF can run any registry size on random weights.

Both transformers 4.x and 5.x are served: the config is built with the keyword names the installed
class takes (5.x nests RoPE in ``rope_parameters``, 4.x takes ``rope_theta`` and ``rope_scaling``);
the model classes' names are the same in both.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from flexoff.models.config import ModelConfig


@dataclass(frozen=True)
class HFArchitecture:
    """The transformers class names that run a flexoff model."""

    config_class: str
    model_class: str


OPT = HFArchitecture("OPTConfig", "OPTForCausalLM")
LLAMA = HFArchitecture("LlamaConfig", "LlamaForCausalLM")
QWEN2 = HFArchitecture("Qwen2Config", "Qwen2ForCausalLM")
QWEN3 = HFArchitecture("Qwen3Config", "Qwen3ForCausalLM")
MIXTRAL = HFArchitecture("MixtralConfig", "MixtralForCausalLM")
QWEN2_MOE = HFArchitecture("Qwen2MoeConfig", "Qwen2MoeForCausalLM")
QWEN3_MOE = HFArchitecture("Qwen3MoeConfig", "Qwen3MoeForCausalLM")


class Unmapped(ValueError):
    """A flexoff config no transformers class reproduces (e.g. a Mixtral with narrower experts)."""


def architecture_of(cfg: ModelConfig) -> HFArchitecture:
    """The transformers architecture whose weights are exactly ``cfg``'s. flexoff's llama family covers
    several HF classes; the switches that tell them apart are the ones only one class has."""
    if cfg.family == "opt":
        return OPT
    if cfg.num_experts:
        if cfg.shared_expert_intermediate_size:
            return QWEN2_MOE
        if cfg.qk_norm:
            return QWEN3_MOE
        # Mixtral: every layer sparse, experts as wide as intermediate_size, renormalised top-k, no biases.
        if (cfg.dense_layers or cfg.expert_intermediate_size != cfg.intermediate_size or not cfg.norm_topk_prob
                or cfg.attention_bias):
            raise Unmapped(f"{cfg.name}: experts without a shared expert or q/k norms are Mixtral's, which has "
                           "no dense layers, no attention bias, renormalised top-k and experts of intermediate_size")
        return MIXTRAL
    if cfg.qk_norm:
        return QWEN3
    # Qwen2 biases q, k and v; Llama and Mistral (a Llama without the window, which flexoff caps) do not.
    return QWEN2 if cfg.attention_bias else LLAMA


def _rope(cfg: ModelConfig) -> dict:
    """RoPE as transformers' rope dict (rope_type and its parameters), None for plain RoPE."""
    scaling = cfg.rope_scaling
    if scaling.kind == "default":
        return {}
    if scaling.kind == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_positions}


def config_kwargs(cfg: ModelConfig, arch: HFArchitecture, takes_rope_parameters: bool) -> dict:
    """The keyword arguments of ``arch``'s config class for ``cfg``."""
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, max_position_embeddings=cfg.max_positions,
                  pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id,
                  eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
                  tie_word_embeddings=cfg.tie_word_embeddings)
    if arch is OPT:
        return dict(common, ffn_dim=cfg.intermediate_size, word_embed_proj_dim=cfg.word_embed_proj_dim,
                    do_layer_norm_before=cfg.do_layer_norm_before,
                    _remove_final_layer_norm=cfg.remove_final_layer_norm, enable_bias=cfg.enable_bias)
    kwargs = dict(common, intermediate_size=cfg.intermediate_size, num_key_value_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, hidden_act="silu")
    rope = _rope(cfg)
    if takes_rope_parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", **rope, "rope_theta": cfg.rope_theta}
    else:
        kwargs.update(rope_theta=cfg.rope_theta, rope_scaling=rope or None)
    if arch in (LLAMA, QWEN3, QWEN3_MOE):
        kwargs["attention_bias"] = cfg.attention_bias
    if arch in (QWEN2, QWEN3, QWEN2_MOE, QWEN3_MOE):
        kwargs["use_sliding_window"] = False
    if arch is MIXTRAL:
        # No window (flexoff caps max_positions at it instead) and no jitter: routing as at inference.
        kwargs.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                      sliding_window=None, router_jitter_noise=0.0)
    if arch in (QWEN2_MOE, QWEN3_MOE):
        kwargs.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                      moe_intermediate_size=cfg.expert_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                      decoder_sparse_step=1, mlp_only_layers=list(cfg.dense_layers))
    if arch is QWEN2_MOE:
        # 4.x always biases q, k and v; 5.x asks qkv_bias.
        kwargs.update(shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                      qkv_bias=cfg.attention_bias)
    return kwargs


def hf_config(cfg: ModelConfig):
    """(the transformers config object for ``cfg``, the causal-LM class that builds it)."""
    import transformers

    arch = architecture_of(cfg)
    config_class = getattr(transformers, arch.config_class, None)
    model_class = getattr(transformers, arch.model_class, None)
    if config_class is None or model_class is None:
        raise Unmapped(f"{cfg.name}: transformers {transformers.__version__} has no {arch.model_class}")
    takes_rope_parameters = "rope_parameters" in inspect.signature(config_class.__init__).parameters
    return config_class(**config_kwargs(cfg, arch, takes_rope_parameters)), model_class


def no_split_modules(model) -> list[str]:
    """The module classes Accelerate must keep whole on one device: the decoder layer, as HF declares it."""
    declared = getattr(model, "_no_split_modules", None)
    if declared:
        return list(declared)
    layers = model.get_decoder().layers
    return [type(layers[0]).__name__]
