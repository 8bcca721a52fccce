"""The weight layout of a whole model is each stage's own layout, stage by stage: sizing stages whose
tensors agree once must not merge stages that differ (a MoE model's dense and sparse layers, the
embedding and the head)."""

import pytest
import torch

from flexoff import Policy, TierFractions
from flexoff.layout import owned_stages, weight_layout
from flexoff.models.config import ModelConfig
from flexoff.policy import CompressionConfig

MOE = ModelConfig(name="tiny-moe", family="llama", vocab_size=64, hidden_size=32, num_layers=5, num_heads=4,
                  num_kv_heads=2, intermediate_size=48, max_positions=64, num_experts=4, experts_per_token=2,
                  expert_intermediate_size=24, dense_layers=(0, 3))
OPT = ModelConfig(name="tiny-opt", family="opt", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4,
                  intermediate_size=64, max_positions=64)


def _own_requests(one, stage):
    """A one-stage layout's host allocations but its disk staging, which comes last."""
    staging = 1 if one.staging.get(stage.kind) and one.buffers.get(stage.kind) else 0
    return one.host_requests[:len(one.host_requests) - staging]


@pytest.mark.parametrize("cfg", [MOE, OPT], ids=["moe-with-dense-layers", "opt"])
@pytest.mark.parametrize("compressed", [False, True], ids=["fp16", "4-bit"])
def test_the_models_layout_is_each_stages_own(cfg, compressed):
    policy = Policy(2, 2, TierFractions(0.3, 0.5, 0.2), TierFractions(0, 1, 0), TierFractions(1, 0, 0),
                    experts=TierFractions(0.25, 0.5, 0.25),
                    compress_weight=CompressionConfig(4, 16) if compressed else None)
    whole = weight_layout(cfg, policy, torch.float16)
    stages = owned_stages(cfg)
    alone = [weight_layout(cfg, policy, torch.float16, owned=range(i, i + 1)) for i in range(len(stages))]
    assert whole.stage_tiers == {stage: one.stage_tiers[stage] for stage, one in zip(stages, alone)}
    own = [request for stage, one in zip(stages, alone) for request in _own_requests(one, stage)]
    assert whole.host_requests[:len(own)] == own
    assert whole.staging == {kind: max(one.staging.get(kind, 0) for one in alone) for kind in whole.staging}
    if cfg.num_experts:  # the dense and the sparse layers are sized apart, the dense ones alike
        layers = [stage for stage in stages if stage.is_layer]
        assert whole.stage_tiers[layers[0]] != whole.stage_tiers[layers[1]]
        assert whole.stage_tiers[layers[0]] == whole.stage_tiers[layers[3]]
