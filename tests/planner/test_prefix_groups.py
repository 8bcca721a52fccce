"""A job whose prompts share their prefixes by groups (MMLU's 12 questions a subject): a GPU batch
of gbs rows holds G = ceil(gbs / group) prefix rows and saves (gbs - G) copies of the prefix, in the
cost model, the planner's memory and the layout it checks with. Hand-computed on the tiny OPT of
test_cost_model (KV 16 bytes per token per layer, W = 472 bytes per layer)."""

import pytest
import torch

from flexoff.errors import ConfigError
from flexoff.layout import job_bytes, pins_host_memory
from flexoff.models import REGISTRY
from flexoff.planner.cost_model import CostModel, Workload
from flexoff.planner.default import job_needs
from flexoff.planner.hardware import packaged_profile
from flexoff.policy import Policy, TierFractions

GPU, CPU = TierFractions(1, 0, 0), TierFractions(0, 1, 0)


@pytest.mark.parametrize("gbs, group, rows", [(48, 12, 4), (48, 0, 1), (48, 48, 1), (48, 100, 1), (10, 4, 3),
                                              (5, 2, 3), (1, 12, 1)])
def test_a_batch_holds_a_prefix_row_per_group_of_its_rows(gbs, group, rows):
    workload = Workload(600, 4, shared_prefix=480, prefix_group=group)
    assert workload.prefix_rows(gbs) == rows
    assert workload.batch_saved_tokens(gbs) == (gbs - rows) * 480


def test_groups_of_one_prompt_share_nothing():
    workload = Workload(600, 4, shared_prefix=480, prefix_group=1)
    assert (workload.batch_prefix(8), workload.prefix_rows(8), workload.batch_saved_tokens(8)) == (0, 1, 0)


@pytest.mark.parametrize("value", [-1, 2.0, True, "3"])
def test_a_prefix_group_is_a_count(value):
    with pytest.raises(ConfigError, match="prefix group must be an integer >= 0"):
        Workload(6, 2, shared_prefix=4, prefix_group=value)


def test_groups_of_rows_are_prefilled_stored_and_moved_once_each_by_hand(tiny_opt, round_hardware):
    # prompt 6 of which 4 shared by pairs, generate 2: a batch of 4 holds 2 prefix rows and
    # prefills 2 x 4 + 4 x 2 = 16 tokens (24 unshared, 12 were all four to share one)
    grouped = CostModel(tiny_opt, Workload(6, 2, shared_prefix=4, prefix_group=2), round_hardware)
    alone = CostModel(tiny_opt, Workload(6, 2), round_hardware)
    policy = Policy(4, 1, CPU, CPU, GPU)
    p, q = grouped.predict(policy), alone.predict(policy)
    assert grouped.prefill_tokens(policy) == 16
    assert p.prefill.io["gpu_to_cpu"] == pytest.approx(16 * 16 / 50)
    assert p.prefill.compute["gpu_elementwise"] == pytest.approx(112 * 16 / 40)
    # two rows' 4 queries over their 4 keys, and each row's own 2 over all 6: 4 x (2 x 16 + 4 x 12) x 4 wide
    assert p.prefill.compute["gpu_attention"] == pytest.approx(4 * (2 * 16 + 4 * 2 * 6) * 4 / 500)
    # a decode step moves each row's own mean 7 - 4 = 3 slots and each pair's 4 shared ones once
    assert p.decode.io["cpu_to_gpu"] == pytest.approx((472 + 16 * (4 * 3 + 2 * 4)) / 100)
    # the cache held on the CPU: 4 - 2 copies of the 4 shared slots fewer, 16 B in each of 2 layers
    assert q.memory_by_phase[("cpu", "decode")] - p.memory_by_phase[("cpu", "decode")] == pytest.approx(2 * 16 * 2 * 4)


@pytest.mark.parametrize("cpu_attention", [False, True])
def test_groups_as_large_as_the_batch_plan_exactly_as_one_prefix(cpu_attention):
    cfg, hw = REGISTRY["opt-30b"], packaged_profile("h200").with_memory(16 << 30)
    policy = Policy(32, 8, TierFractions(0.2, 0.8, 0), TierFractions(0, 0.5, 0.5), GPU, cpu_attention=cpu_attention)
    one = CostModel(cfg, Workload(600, 4, 684, shared_prefix=480), hw).predict(policy)
    for group in (32, 684):
        same = CostModel(cfg, Workload(600, 4, 684, shared_prefix=480, prefix_group=group), hw).predict(policy)
        assert (same.prefill, same.decode, same.peak_memory) == (one.prefill, one.decode, one.peak_memory)
    # 12 a subject: three prefix rows a batch of 32, so less saved than one, more than none
    mmlu = CostModel(cfg, Workload(600, 4, 684, shared_prefix=480, prefix_group=12), hw).predict(policy)
    none = CostModel(cfg, Workload(600, 4, 684), hw).predict(policy)
    for tier in ("gpu", "cpu", "disk"):
        assert one.peak_memory[tier] < mmlu.peak_memory[tier] < none.peak_memory[tier], tier
    assert one.prefill_seconds < mmlu.prefill_seconds < none.prefill_seconds


def test_the_default_plans_check_counts_every_prefix_row_as_the_layout_does():
    cfg, policy = REGISTRY["opt-125m"], Policy(8, 2)
    needs = job_needs(cfg, policy, torch.float16, Workload(64, 8, shared_prefix=40, prefix_group=3))
    assert needs == job_bytes(cfg, policy, torch.float16, 64, 8, pins_host_memory(True), prefix_len=40, prefix_rows=3)
    one = job_needs(cfg, policy, torch.float16, Workload(64, 8, shared_prefix=40))
    assert one["gpu"] < needs["gpu"] < job_needs(cfg, policy, torch.float16, Workload(64, 8))["gpu"]
