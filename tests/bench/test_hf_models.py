"""flexoff's model configs as the transformers models the HF baseline builds: for each family, the HF
model has flexoff's parameter count, and its config.json reads back into the same flexoff config."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from hf_models import Unmapped, architecture_of, hf_config, no_split_modules  # noqa: E402
from flexoff.models import ModelConfig, config_from_dir, stage_specs, stages  # noqa: E402
from flexoff.models.config import RopeScaling  # noqa: E402
from flexoff.planner.sizes import parameter_count  # noqa: E402

transformers = pytest.importorskip("transformers")

LLAMA = dict(family="llama", vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
             intermediate_size=40, max_positions=64, tie_word_embeddings=False, bos_token_id=1,
             eos_token_ids=(2,), pad_token_id=0, rope_theta=1000000.0, norm_eps=1e-6)
TINY = {
    "opt": ModelConfig(name="opt", family="opt", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                       intermediate_size=48, max_positions=64, bos_token_id=2, eos_token_ids=(2,), pad_token_id=1),
    "opt-proj": ModelConfig(name="opt-proj", family="opt", vocab_size=96, hidden_size=32, num_layers=2, num_heads=4,
                            intermediate_size=48, max_positions=64, word_embed_proj_dim=16,
                            do_layer_norm_before=False, bos_token_id=2, eos_token_ids=(2,), pad_token_id=1),
    "llama": ModelConfig(name="llama", **LLAMA),
    "llama3-rope": ModelConfig(name="llama3-rope", **{**LLAMA, "rope_scaling": RopeScaling(
        kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=16)}),
    "qwen2": ModelConfig(name="qwen2", **LLAMA, attention_bias=True),
    "qwen3": ModelConfig(name="qwen3", **LLAMA, head_dim=16, qk_norm=True),
    "mixtral": ModelConfig(name="mixtral", **{**LLAMA, "intermediate_size": 24}, num_experts=4, experts_per_token=2),
    "qwen3-moe": ModelConfig(name="qwen3-moe", **LLAMA, head_dim=16, qk_norm=True, num_experts=6,
                             experts_per_token=2, expert_intermediate_size=16),
    "qwen2-moe": ModelConfig(name="qwen2-moe", **LLAMA, attention_bias=True, num_experts=5, experts_per_token=3,
                             expert_intermediate_size=16, shared_expert_intermediate_size=24, norm_topk_prob=False),
}
CLASSES = {"opt": "OPTForCausalLM", "opt-proj": "OPTForCausalLM", "llama": "LlamaForCausalLM",
           "llama3-rope": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "mixtral": "MixtralForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM", "qwen2-moe": "Qwen2MoeForCausalLM"}


def build(cfg: ModelConfig):
    config, model_class = hf_config(cfg)
    with torch.device("meta"):
        return config, model_class(config)


def spec_count(cfg: ModelConfig) -> int:
    """Parameters as flexoff's stages hold them, layer by layer, a tied head once."""
    total = sum(spec.numel for stage in stages(cfg) for spec in stage_specs(cfg, stage))
    return total - (cfg.vocab_size * cfg.word_embed_proj_dim if cfg.tie_word_embeddings else 0)


@pytest.mark.parametrize("kind", list(TINY))
def test_the_hf_model_has_flexoffs_parameters(kind):
    cfg = TINY[kind]
    _, model = build(cfg)
    assert type(model).__name__ == CLASSES[kind]
    assert sum(p.numel() for p in model.parameters()) == parameter_count(cfg)


@pytest.mark.parametrize("kind", list(TINY))
def test_the_hf_config_reads_back_as_the_same_flexoff_config(kind, tmp_path):
    """What the count cannot see (routing switches, RoPE, token ids) survives the trip through config.json."""
    cfg = TINY[kind]
    config, _ = build(cfg)
    config.save_pretrained(tmp_path)
    assert dataclasses.replace(config_from_dir(tmp_path), name=cfg.name) == cfg


def test_dense_layers_of_a_mixture_of_experts_stay_dense(tmp_path):
    cfg = TINY["qwen3-moe"].replace(dense_layers=(1,))
    config, model = build(cfg)
    assert sum(p.numel() for p in model.parameters()) == spec_count(cfg)
    config.save_pretrained(tmp_path)
    assert dataclasses.replace(config_from_dir(tmp_path), name=cfg.name) == cfg


def test_accelerate_keeps_each_decoder_layer_whole():
    _, model = build(TINY["mixtral"])
    assert no_split_modules(model) == ["MixtralDecoderLayer"]


@pytest.mark.parametrize("change", [dict(expert_intermediate_size=16), dict(norm_topk_prob=False),
                                   dict(dense_layers=(0,))])
def test_a_mixture_no_hf_class_reproduces_is_refused(change):
    cfg = TINY["mixtral"].replace(**change)
    with pytest.raises(Unmapped, match="Mixtral"):
        architecture_of(cfg)
