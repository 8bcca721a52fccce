"""CPU attention over part of the CPU cache while the rest travels: the cost model's terms by hand
(tiny OPT and round hardware, as in test_cost_model), and the search's choice of the split."""

import dataclasses

import pytest

from flexoff.models.config import REGISTRY
from flexoff.planner.cost_model import CostModel, Placement, PolicyFrame, Workload
from flexoff.planner.hardware import packaged_profile
from flexoff.planner.report import policy_summary
from flexoff.planner.search import candidate_frames, round_fractions, search_policy
from flexoff.policy import CompressionConfig, Policy, TierFractions

GPU, CPU = TierFractions(1, 0, 0), TierFractions(0, 1, 0)
GiB = 1 << 30


def offloaded(**changes) -> Policy:
    values = dict(gpu_batch_size=2, num_gpu_batches=1, weights=CPU, cache=CPU, activations=GPU, cpu_attention=True)
    values.update(changes)
    return Policy(**values)


def test_half_the_cpu_cache_travels_by_hand(tiny_opt, make_hardware):
    contended = make_hardware(cpu_attention_share_under_copy=0.5)
    p = CostModel(tiny_opt, Workload(4, 3), contended).predict(offloaded(cpu_attention_split=0.5))
    # Weights (472 B), one of the two sequences' cache (16 B x 5.5 tokens) and the other's 8-byte
    # attention output cross to the GPU.
    assert p.decode.io["cpu_to_gpu"] == pytest.approx((472 + 88 + 8) / 100)
    # Both sequences' new keys and values (32 B) go home; one query (8 B) goes to the CPU.
    assert p.decode.io["gpu_to_cpu"] == pytest.approx(32 / 50 + 8 / 50)
    # One sequence attends on the GPU (4.4 s), one on the CPU (88 FLOPs at 4 FLOP/s), which runs at
    # half speed while the weights and the travelling cache stream: (1 - 0.5) x 5.6 s later.
    assert p.decode.compute["gpu_attention"] == pytest.approx(4.4)
    assert p.decode.compute["cpu_attention"] == pytest.approx(88 / 4 + 0.5 * (472 + 88) / 100)
    # The prefill does not depend on where decode attends.
    assert p.prefill == CostModel(tiny_opt, Workload(4, 3), contended).predict(offloaded()).prefill


def test_the_travelling_rows_take_gpu_workspace_and_free_cpu_workspace(tiny_opt, round_hardware):
    model = CostModel(tiny_opt, Workload(4, 3), round_hardware)
    whole, half = (model.predict(offloaded(cpu_attention_split=s)).memory_by_phase for s in (1.0, 0.5))
    # A ring of two for one sequence's cache: 2 x 16 B x 7 slots.
    assert half[("gpu", "decode")] - whole[("gpu", "decode")] == pytest.approx(2 * 16 * 7)
    # CPU attention's fp32 keys and values (8 elements) and scores (2 heads) of one sequence fewer.
    assert whole[("cpu", "decode")] - half[("cpu", "decode")] == pytest.approx(7 * (8 * 4 + 2 * 2 * 4))
    assert half[("gpu", "prefill")] == whole[("gpu", "prefill")]


def test_the_extremes_are_the_two_paths(tiny_opt, make_hardware):
    """A split of 1 is plain CPU attention. One of 0 moves what the shipped path moves; only the
    slowdown of CPU attention under copies stays, priced as if CPU attention outlasted them (the
    tangent that is exact where a split balances the two paths)."""
    for share in (1.0, 0.4):
        model = CostModel(tiny_opt, Workload(4, 3), make_hardware(cpu_attention_share_under_copy=share))
        shipped = model.predict(offloaded(cpu_attention_split=0.0))
        plain = model.predict(offloaded(cpu_attention=False))
        assert shipped.decode.io == plain.decode.io
        assert shipped.peak_memory == pytest.approx(plain.peak_memory)
        assert {k: v for k, v in shipped.decode.compute.items() if k != "cpu_attention"} == \
            {k: v for k, v in plain.decode.compute.items() if k != "cpu_attention"}
        assert shipped.decode.compute["cpu_attention"] == pytest.approx((1 - share) * (472 + 176) / 100)
        assert model.predict(offloaded(cpu_attention_split=1.0)) == model.predict(offloaded())


def test_without_overlap_cpu_attention_is_not_slowed_by_copies(tiny_opt, make_hardware):
    contended = make_hardware(cpu_attention_share_under_copy=0.5)
    p = CostModel(tiny_opt, Workload(4, 3), contended).predict(offloaded(overlap=False))
    assert p.decode.compute["cpu_attention"] == pytest.approx(2 * 88 / 4)


def test_a_split_never_slows_down_with_more_bandwidth_or_less_contention(tiny_opt, round_hardware):
    policy = offloaded(cache=TierFractions(0.2, 0.8, 0), weights=TierFractions(0.3, 0.7, 0), gpu_batch_size=5,
                       cpu_attention_split=0.5)
    base = CostModel(tiny_opt, Workload(4, 3), round_hardware).predict(policy).block_latency
    for name in ("cpu_to_gpu_bandwidth", "gpu_to_cpu_bandwidth", "decode_attention_flops", "gpu_memory_bandwidth",
                 "cpu_attention_flops"):
        faster = dataclasses.replace(round_hardware, **{name: getattr(round_hardware, name) * 3})
        assert CostModel(tiny_opt, Workload(4, 3), faster).predict(policy).block_latency <= base
    latencies = [CostModel(tiny_opt, Workload(4, 3), dataclasses.replace(round_hardware,
                                                                           cpu_attention_share_under_copy=f))
                 .predict(policy).block_latency for f in (0.2, 0.5, 0.8, 1.0)]
    assert latencies == sorted(latencies, reverse=True)


def test_the_split_round_trips_through_a_frame():
    policy = offloaded(gpu_batch_size=8, cache=TierFractions(0.25, 0.75, 0), cpu_attention_split=2 / 3)
    p = Placement.of(policy)
    assert p.cs == pytest.approx(0.25)  # 2 of the 6 cpu rows of 8 travel
    again = PolicyFrame.of(policy).with_placement(round_fractions(p, 6))
    assert again.cpu_attention_split == pytest.approx(2 / 3, abs=1e-5)
    assert PolicyFrame.of(policy).split_cpu_attention and not PolicyFrame.of(offloaded()).split_cpu_attention


def test_cpu_attention_frames_come_plain_and_split():
    kinds = {(f.cpu_attention, f.split_cpu_attention) for f in candidate_frames("off", "auto", (4,), (1,))}
    assert kinds == {(False, False), (True, False), (True, True)}
    assert {f.split_cpu_attention for f in candidate_frames("off", "off", (4,), (1,))} == {False}


def test_the_summary_says_how_much_of_the_cpu_cache_the_cpu_attends(tiny_opt, round_hardware):
    from flexoff.commands.report import format_prediction

    split = offloaded(gpu_batch_size=16, num_gpu_batches=8, cpu_attention_split=0.625)
    assert policy_summary(split).endswith(" cpu-attention 62.5% (rest travels)")
    assert policy_summary(offloaded()).endswith(" cpu-attention")
    report = format_prediction(CostModel(tiny_opt, Workload(4, 3), round_hardware).predict(split))
    assert "on for 62.5% of the cpu cache's sequences; the rest travel to the GPU" in report


def _per_sequence_costs(name: str, compression, hardware, workload: Workload):
    """From the profile's numbers: seconds of one sequence's decode attention in one layer on the
    CPU (alone), and of shipping its cache to the GPU instead."""
    config = REGISTRY[name]
    s_avg = workload.prompt_len + workload.gen_len / 2
    attend = 4 * s_avg * config.num_heads * config.head_dim / hardware.cpu_attention_flops
    kv_bytes = 2 * config.num_kv_heads * config.head_dim * (2 if compression is None else compression.bits / 8)
    if compression is not None:
        attend += s_avg * 2 * config.num_kv_heads * config.head_dim / hardware.cpu_dequant_throughput
    return attend, s_avg * kv_bytes / hardware.cpu_to_gpu_bandwidth


def test_an_fp16_cache_is_split_on_a_capped_h100_and_a_4bit_one_mostly_travels():
    """OPT-30B under 16 GiB keeps its whole cache on the CPU. In fp16, attending a sequence on the
    CPU costs about as much as shipping its cache, and copies hardly slow CPU attention: a split lets
    both paths work, so the search should pick one strictly between 0 and 1. Compressed, the cache is
    a quarter of the bytes but CPU attention must dequantize it too: the search does not split it."""
    hardware = packaged_profile("h100").with_memory(gpu=16 * GiB)
    workload = Workload(512, 32)
    share = hardware.cpu_attention_share_under_copy
    attend, ship = _per_sequence_costs("opt-30b", None, hardware, workload)
    # Moving a sequence to the GPU saves its CPU attention and costs the slowdown its copy brings;
    # moving it to the CPU saves its copy: both moves pay somewhere, so a mix balances the two.
    assert attend > (1 - share) * ship and ship > 0
    grid = dict(gpu_batch_sizes=(8, 16, 32), num_gpu_batches=(2, 4, 5, 8))
    fp16 = search_policy(REGISTRY["opt-30b"], workload, hardware, compress="off", cpu_attention="on", **grid)
    assert fp16.policy.cache.cpu == 1.0
    assert 0 < fp16.policy.cpu_attention_split < 1
    attended = fp16.policy.cpu_attention_split * fp16.policy.gpu_batch_size
    assert attended == pytest.approx(round(attended), abs=1e-4)  # whole sequences, as the runtime splits
    model = CostModel(REGISTRY["opt-30b"], workload, hardware)
    for extreme in (dict(cpu_attention_split=1.0), dict(cpu_attention=False, cpu_attention_split=1.0)):
        assert model.predict(dataclasses.replace(fp16.policy, **extreme)).total_throughput < fp16.throughput
    four_bit = CompressionConfig(4, 64)
    attend4, ship4 = _per_sequence_costs("opt-30b", four_bit, hardware, workload)
    assert attend4 / ship4 > attend / ship
    compressed = search_policy(REGISTRY["opt-30b"], workload, hardware, compress="on", cpu_attention="on", **grid)
    assert compressed.policy.cpu_attention_split == 1.0
