"""The cost model and the planner count a GPU batch's shared prefix once: its prefill, its cache's
bytes in both phases, and the peak memory. Hand-computed on the tiny OPT of test_cost_model (KV 16
bytes per token per layer, W = 472 bytes per layer), then on OPT-30B on the H200's profile."""

import dataclasses

import pytest
import torch

from flexoff.errors import ConfigError
from flexoff.layout import job_bytes, pins_host_memory
from flexoff.models import REGISTRY
from flexoff.planner.cost_model import CostModel, Workload
from flexoff.planner.default import job_needs
from flexoff.planner.hardware import packaged_profile
from flexoff.planner.search import search_policy
from flexoff.policy import Policy, TierFractions

GPU, CPU, DISK = TierFractions(1, 0, 0), TierFractions(0, 1, 0), TierFractions(0, 0, 1)
GiB = 1 << 30


def test_the_prefix_is_prefilled_stored_and_moved_once_per_batch_by_hand(tiny_opt, round_hardware):
    # prompt 6 of which 4 shared, generate 2: a batch of 2 prefills 4 + 2 x 2 = 8 tokens, not 12
    shared = CostModel(tiny_opt, Workload(6, 2, shared_prefix=4), round_hardware)
    alone = CostModel(tiny_opt, Workload(6, 2), round_hardware)
    policy = Policy(2, 1, CPU, CPU, GPU)
    p, q = shared.predict(policy), alone.predict(policy)
    assert p.prefill.io["gpu_to_cpu"] == pytest.approx(16 * 8 / 50)
    assert q.prefill.io["gpu_to_cpu"] == pytest.approx(16 * 12 / 50)
    # element-wise 112 B per token (see test_cost_model) over the tokens computed
    assert p.prefill.compute["gpu_elementwise"] == pytest.approx(112 * 8 / 40)
    # one row's 4 queries over its 4 keys, and each row's own 2 over all 6: 4 x (16 + 24) x 4 wide
    assert p.prefill.compute["gpu_attention"] == pytest.approx(4 * (16 + 2 * 2 * 6) * 4 / 500)
    # a decode step moves each row's own mean 7 - 4 = 3 slots and the batch's 4 shared ones once
    assert p.decode.io["cpu_to_gpu"] == pytest.approx((472 + 16 * (2 * 3 + 4)) / 100)
    assert q.decode.io["cpu_to_gpu"] == pytest.approx((472 + 16 * 2 * 7) / 100)
    # the cache held on the CPU: one copy of the 4 shared slots fewer, 16 B in each of 2 layers
    assert q.memory_by_phase[("cpu", "decode")] - p.memory_by_phase[("cpu", "decode")] == pytest.approx(2 * 16 * 4)


def test_a_batch_of_one_row_shares_nothing(tiny_opt, round_hardware):
    shared = CostModel(tiny_opt, Workload(6, 2, shared_prefix=4), round_hardware)
    alone = CostModel(tiny_opt, Workload(6, 2), round_hardware)
    policy = Policy(1, 2, CPU, CPU, GPU)
    p, q = shared.predict(policy), alone.predict(policy)
    assert (p.prefill, p.decode, p.peak_memory) == (q.prefill, q.decode, q.peak_memory)


@pytest.mark.parametrize("value", [-1, 6, 7, 2.0, True, "3"])
def test_a_shared_prefix_must_leave_a_prompt_token_of_its_own(value):
    with pytest.raises(ConfigError, match="shared prefix must be an integer from 0 to prompt length - 1 \\(5\\)"):
        Workload(6, 2, shared_prefix=value)


def _mmlu(shared: int) -> Workload:
    """An MMLU-shaped job: 480 tokens of in-context examples before each question, 4 new tokens."""
    return Workload(600, 4, 684, shared_prefix=shared)


@pytest.mark.parametrize("cpu_attention", [False, True])
def test_a_long_shared_prefix_predicts_a_faster_prefill_and_fewer_decode_cache_bytes(cpu_attention):
    cfg, hw = REGISTRY["opt-30b"], packaged_profile("h200").with_memory(16 * GiB)
    policy = Policy(32, 8, TierFractions(0.2, 0.8, 0), TierFractions(0, 0.5, 0.5), GPU, cpu_attention=cpu_attention)
    p = CostModel(cfg, _mmlu(480), hw).predict(policy)
    q = CostModel(cfg, _mmlu(0), hw).predict(policy)
    assert p.prefill_seconds < q.prefill_seconds
    assert p.prefill.compute_seconds < q.prefill.compute_seconds
    # the cache's disk rows are read once a batch for the prefix, with or without CPU attention
    assert p.decode.io["disk_to_cpu"] < q.decode.io["disk_to_cpu"]
    if cpu_attention:
        assert p.decode.compute["cpu_attention"] < q.decode.compute["cpu_attention"]
        assert p.decode.io["cpu_to_gpu"] == q.decode.io["cpu_to_gpu"]  # only queries and outputs cross
    else:
        assert p.decode.io["cpu_to_gpu"] < q.decode.io["cpu_to_gpu"]
    for tier in ("gpu", "cpu", "disk"):
        assert p.peak_memory[tier] < q.peak_memory[tier], tier


def test_a_shared_prefix_fits_a_larger_block_under_the_same_gpu_cap():
    cfg, hw = REGISTRY["opt-30b"], packaged_profile("h200").with_memory(16 * GiB)
    options = dict(compress="off", cpu_attention="off")
    shared = search_policy(cfg, _mmlu(480), hw, **options)
    alone = search_policy(cfg, _mmlu(0), hw, **options)
    assert shared.prediction.fits and alone.prediction.fits
    assert shared.policy.block_size > alone.policy.block_size
    # the shared job's policy, planned for whole prompts, does not fit that cap
    assert not CostModel(cfg, _mmlu(0), hw).predict(shared.policy).fits


def test_the_default_plans_check_counts_the_prefix_as_the_layout_does():
    cfg, policy = REGISTRY["opt-125m"], Policy(8, 2)
    needs = job_needs(cfg, policy, torch.float16, Workload(64, 8, shared_prefix=40))
    assert needs == job_bytes(cfg, policy, torch.float16, 64, 8, pins_host_memory(True), prefix_len=40)
    assert needs["gpu"] < job_needs(cfg, policy, torch.float16, Workload(64, 8))["gpu"]
    # one row a batch: nothing shared
    single = Policy(1, 2)
    assert (job_needs(cfg, single, torch.float16, Workload(64, 8, shared_prefix=40))
            == job_needs(cfg, single, torch.float16, Workload(64, 8)))


def test_a_batchs_prefixes_are_a_second_cache_the_host_issues_work_for(tiny_opt, make_hardware):
    # Per decode layer: 0.5 s a batch, 0.25 more where its cache travels, 0.125 more where the GPU
    # reads it compressed; CPU attention 0.5 s a call of up to 32 rows.
    from flexoff.policy import CompressionConfig

    hardware = make_hardware(host_seconds_per_layer=0.5, host_seconds_per_travelling_layer=0.25,
                             host_seconds_per_compressed_cache_layer=0.125, cpu_attention_seconds_per_call=0.5)
    four_bit = CompressionConfig(4, 64)

    def decode(shared: int, group: int = 0, **changes):
        policy = Policy(**{**dict(gpu_batch_size=4, num_gpu_batches=2, weights=GPU, cache=CPU, activations=GPU,
                                  compress_cache=four_bit), **changes})
        return CostModel(tiny_opt, Workload(6, 2, shared_prefix=shared, prefix_group=group), hardware).predict(policy)

    # Two batches, each its rows' cache and its prefixes' travelling compressed: 2 x 2 x 0.375.
    assert decode(0).decode.io["host"] == pytest.approx(2 * 0.5 + 2 * 0.375)
    assert decode(4).decode.io["host"] == pytest.approx(2 * 0.5 + 2 * 2 * 0.375)
    # A batch of one row holds no prefix: nothing more.
    assert decode(4, gpu_batch_size=1).decode.io["host"] == decode(0, gpu_batch_size=1).decode.io["host"]
    # Under CPU attention (its FLOPs free here) each batch's two prefix rows are one call more.
    hardware = dataclasses.replace(hardware, cpu_attention_flops=1e30)
    on_cpu = dict(cpu_attention=True, compress_cache=None)
    alone, shared = decode(0, **on_cpu).decode.compute, decode(4, 2, **on_cpu).decode.compute
    assert shared["cpu_attention"] - alone["cpu_attention"] == pytest.approx(2 * 0.5)


def test_a_generated_token_weighs_its_predicted_cost_in_prompt_tokens(tiny_opt, round_hardware):
    model = CostModel(tiny_opt, Workload(5, 3, shared_prefix=3), round_hardware)
    p = model.predict(Policy(2, 2, CPU, CPU, GPU))
    # A block of 4 computes 2 batches x (3 + 2 x 2) = 14 prompt positions and 4 x 2 generated tokens.
    per_prompt, per_generated = p.prefill_seconds / 14, p.decode_seconds / 8
    assert p.generated_token_weight == max(1, round(per_generated / per_prompt))
    assert dataclasses.replace(p, decode_seconds=p.prefill_seconds / 14 * 8 * 37).generated_token_weight == 37
    assert dataclasses.replace(p, decode_seconds=p.prefill_seconds / 100).generated_token_weight == 1
    # Nothing generated after the prefill: no weight to give.
    assert CostModel(tiny_opt, Workload(6, 1), round_hardware).predict(Policy(2, 2, CPU, CPU, GPU)) \
        .generated_token_weight == 1
