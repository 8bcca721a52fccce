"""The expert-touch estimate against routing counted on random router logits, and the expert bytes
it weighs, against the tensors a checkpoint holds."""

import math

import pytest
import torch

from flexoff.compression import compressed_nbytes
from flexoff.models import REGISTRY, resolve_model_config
from flexoff.layout import expected_experts_touched
from flexoff.planner.experts import expected_expert_bytes, expert_bytes_per_layer
from flexoff.policy import CompressionConfig

TRIALS = 4000


@pytest.mark.parametrize("experts, k, tokens", [
    (8, 2, 1), (8, 2, 3), (8, 2, 12), (60, 4, 10), (128, 8, 4), (128, 8, 32), (128, 8, 96),
])
def test_expected_touch_matches_routing_counted_on_random_logits(experts, k, tokens):
    """Each trial routes ``tokens`` tokens by top-k over standard normal logits (as a router whose
    experts are alike does) and counts the distinct experts chosen. The mean of 4000 trials lies
    within four standard errors of the expectation unless the formula is wrong: by chance that
    fails with probability under 1e-4, and the seed makes the draw the same every run. The
    standard error is the count's own under uniform routing: an expert is missed by all tokens
    with probability q1, a given pair of experts with probability q2."""
    generator = torch.Generator().manual_seed(experts * 1000 + tokens)
    logits = torch.randn(TRIALS, tokens, experts, generator=generator)
    chosen = torch.topk(logits, k, dim=-1).indices.reshape(TRIALS, -1)
    touched = torch.zeros(TRIALS, experts).scatter_(1, chosen, 1.0).sum(dim=1).double()
    q1 = ((experts - k) / experts) ** tokens
    q2 = ((experts - k) * (experts - k - 1) / (experts * (experts - 1))) ** tokens
    missed_variance = experts * q1 + experts * (experts - 1) * q2 - (experts * q1) ** 2
    standard_error = math.sqrt(max(missed_variance, 0.0) / TRIALS)
    assert touched.std().item() == pytest.approx(math.sqrt(max(missed_variance, 0.0)), rel=0.1, abs=1e-3)
    expected = expected_experts_touched(experts, k, tokens)
    assert k <= expected <= experts
    assert touched.mean().item() == pytest.approx(expected, abs=4 * standard_error + 1e-9)


def test_touch_at_the_edges():
    assert expected_experts_touched(8, 2, 0) == 0
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2)  # one token: exactly its k
    assert expected_experts_touched(8, 8, 5) == pytest.approx(8)  # k = E: every expert
    assert expected_experts_touched(128, 8, 10_000) == pytest.approx(128)  # throughput blocks touch all
    assert expected_experts_touched(0, 0, 100) == 0  # a dense model has none


@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_expert_bytes_are_the_checkpoints_expert_tensors(tiny_model_dir, kind):
    """All routed experts' bytes, fp16 and 4-bit, against the tensors transformers holds (the shared
    expert and the router are not routed); a dense layer (qwen3-moe's second, qwen2-moe's first) has
    none, so the per-layer mean is half a sparse layer's."""
    path, model = tiny_model_dir(kind)
    config = resolve_model_config(str(path))
    routed = [p for name, p in model.named_parameters() if ".experts." in name or name.endswith(".experts")
              or "experts.gate_up_proj" in name or "experts.down_proj" in name]
    assert routed
    fp16 = 2 * sum(p.numel() for p in routed)
    assert expert_bytes_per_layer(config, None) * config.num_layers == fp16
    four_bit = CompressionConfig(4, 4)
    packed = sum(compressed_nbytes(tuple(p.shape), 4, 4) for p in routed)
    assert expert_bytes_per_layer(config, four_bit) * config.num_layers == pytest.approx(packed)
    # One token touches k of E experts; a large block all of them.
    share = config.experts_per_token / config.num_experts
    assert expected_expert_bytes(config, None, 1) == pytest.approx(share * fp16 / config.num_layers)
    assert expected_expert_bytes(config, None, 10_000) == pytest.approx(fp16 / config.num_layers)


def test_a_dense_model_has_no_expert_bytes():
    config = REGISTRY["llama-3-8b"]
    assert expert_bytes_per_layer(config, None) == 0 and expected_expert_bytes(config, None, 64) == 0
