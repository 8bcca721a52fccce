"""A job whose prompts differ in length: the workload carries their mean, the prefill's matmuls are
priced at it (the runtime forms blocks by length and packs what still pads), while memory, the
cache's new slots and the activations stay planned padded to the longest."""

import pytest

from flexoff.errors import ConfigError
from flexoff.models.registry import resolve_model_config
from flexoff.planner.cost_model import CostModel, Workload
from flexoff.planner.frame import Placement, PolicyFrame
from flexoff.planner.hardware import resolve_hardware
from flexoff.planner.search import search_policy
from flexoff.policy import CompressionConfig, Policy, TierFractions
from flexoff.prompts import prompt_workload


def test_the_mean_reaches_the_workload_where_lengths_differ():
    varied = prompt_workload([[5] * 4, [6] * 10, [7] * 7], [3, 3, 3], "opt-125m", None)
    assert (varied.prompt_len, varied.mean_prompt_len) == (10, 7.0)
    assert prompt_workload([[5, 6]] * 3, [3] * 3, "opt-125m", None).mean_prompt_len == 0


def test_the_positions_a_block_computes_by_hand():
    # 8 rows of a mean 30 positions, 3 batches: 240 a batch instead of 8 x 50 padded.
    job = Workload(50, 4, 24, mean_prompt_len=30.0)
    assert job.block_prefill_positions(8, 3) == 3 * 400
    assert job.block_prefill_tokens(8, 3) == 3 * 240
    assert Workload(50, 4, 24).block_prefill_tokens(8, 3) == 3 * 400
    # Behind shared prefixes of 20 in groups of 4: a batch of 8 holds 2 prefixes, so it computes
    # 8 x 30 - 6 x 20 = 120 positions (each row's 10 on average and the prefixes once), 280 padded.
    shared = Workload(50, 4, 24, shared_prefix=20, prefix_group=4, mean_prompt_len=30.0)
    assert shared.block_prefill_positions(8, 1) == 8 * 50 - 6 * 20
    assert shared.block_prefill_tokens(8, 1) == 8 * 30 - 6 * 20
    # A mean at the prefix (a planned share past the rows' mean): each row still computes one
    # position of its own beside its batch's two prefixes.
    short = Workload(50, 4, 24, shared_prefix=20, prefix_group=4, mean_prompt_len=20.0)
    assert short.block_prefill_tokens(8, 1) == 8 + 2 * 20


def test_the_prefill_matmuls_are_priced_at_the_mean_and_the_rest_padded():
    cfg, hardware = resolve_model_config("opt-6.7b"), resolve_hardware("h200")
    policy = Policy(8, 3, TierFractions(1, 0, 0), TierFractions(0, 1, 0), TierFractions(0, 1, 0),
                    compress_cache=CompressionConfig(4, 64))
    padded, varied = Workload(512, 8, 48), Workload(512, 8, 48, mean_prompt_len=256.0)
    frame, place = PolicyFrame.of(policy), Placement.of(policy, cfg)
    (p_io, p_compute), (v_io, v_compute) = (CostModel(cfg, w, hardware).phase_terms(frame, place)["prefill"]
                                            for w in (padded, varied))
    model = CostModel(cfg, varied, hardware)
    assert v_compute["gpu_matmul"] == pytest.approx(model.matmul_seconds(24 * 256, 24, 8 * 256))
    full = CostModel(cfg, padded, hardware)
    assert p_compute["gpu_matmul"] == pytest.approx(full.matmul_seconds(24 * 512, 24, 8 * 512))
    assert v_compute["gpu_elementwise"] == pytest.approx(p_compute["gpu_elementwise"] / 2)
    # The new cache is quantized and stored padded; the activations travel padded.
    for name in ("dequantize", "activation_copies"):
        assert v_compute[name] == pytest.approx(p_compute[name])
    assert v_io == p_io
    assert CostModel(cfg, varied, hardware).predict(policy).peak_memory == \
        CostModel(cfg, padded, hardware).predict(policy).peak_memory


def test_the_search_plans_memory_for_the_longest_and_predicts_the_mean():
    cfg = resolve_model_config("opt-30b")
    hardware = resolve_hardware("h200").with_memory(gpu=16 << 30)
    varied, padded = Workload(600, 8, 480, mean_prompt_len=350.0), Workload(600, 8, 480)
    got, full = (search_policy(cfg, w, hardware, compress="auto") for w in (varied, padded))
    assert got.prediction.fits
    # Fewer positions to prefill: the same policy predicts faster, and the searched one no slower.
    assert CostModel(cfg, varied, hardware).predict(full.policy).total_throughput > full.throughput
    assert got.throughput >= CostModel(cfg, varied, hardware).predict(full.policy).total_throughput * (1 - 1e-9)


def test_a_cut_or_a_share_keeps_the_mean_within_the_prompts():
    job = Workload(40, 9, 6, mean_prompt_len=30.0)
    assert job.with_generation(24, 9).mean_prompt_len == 24
    assert job.with_generation(40, 5).mean_prompt_len == 30.0
    assert job.with_prompts(3).mean_prompt_len == 30.0


@pytest.mark.parametrize("mean", [-1.0, 0.5, 41.0, True, "30"])
def test_a_mean_outside_the_prompts_is_refused(mean):
    with pytest.raises(ConfigError, match="mean prompt length"):
        Workload(40, 9, 6, mean_prompt_len=mean)
