"""Pinned host memory comes in slabs, and the memory estimates reserve what the slabs take: they
replay the runtime's own host allocations, in its order, through the same packing."""

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.runtime import tiers
from flexoff.runtime.memory import block_host_requests, weight_bytes, weight_host_requests
from flexoff.runtime.policy import CompressionConfig
from flexoff.runtime.tiers import SlabPlan, slab_bytes

MiB, GiB = 1 << 20, 1 << 30


def test_slab_plan_fits_first_at_aligned_offsets():
    plan = SlabPlan()
    assert plan.place(600 * MiB) == (0, 0)
    assert plan.place(600 * MiB) == (1, 0)  # 424 MiB left in the first slab
    assert plan.place(300 * MiB) == (0, 600 * MiB)  # the first slab that has room
    assert plan.place(100) == (0, 900 * MiB)
    assert plan.place(100) == (0, 900 * MiB + SlabPlan.ALIGN)
    assert plan.place(2 * GiB + 1) == (2, 0)  # a slab of its own, the next power of two
    assert [size for size, _ in plan.slabs] == [GiB, GiB, 4 * GiB]
    assert plan.reserved == slab_bytes([600 * MiB, 600 * MiB, 300 * MiB, 100, 100, 2 * GiB + 1]) == 6 * GiB


def test_pinned_weights_reserve_their_slabs():
    from flexoff.models import REGISTRY

    cfg = REGISTRY["opt-30b"]
    on_cpu = Policy(1, 1, TierFractions(0, 1, 0), TierFractions(1, 0, 0), TierFractions(1, 0, 0))
    requests = weight_host_requests(cfg, on_cpu, torch.float16)
    plain = weight_bytes(cfg, on_cpu, torch.float16)["cpu"]
    pinned = weight_bytes(cfg, on_cpu, torch.float16, pinned=True)["cpu"]
    assert plain == sum(requests) == 2 * sum(spec.numel for spec in _all_specs(cfg))
    # 411 MB and 103 MB matrices leave the ends of 1 GiB slabs unused: 6% more than the weights.
    assert pinned == slab_bytes(requests)
    assert 1.04 * plain < pinned < 1.08 * plain


def _all_specs(cfg):
    from flexoff.models import stage_names, stage_specs

    return [spec for stage in stage_names(cfg) for spec in stage_specs(cfg, stage)]


@pytest.mark.parametrize("compress", [False, True])
def test_estimates_replay_the_runtimes_host_allocations(tiny_model_dir, tmp_path, monkeypatch, compress):
    """Every host allocation of the weight store and of a block, in order, as the estimates list them."""
    made: dict[int, list[int]] = {}
    allocate = tiers.HostMemory.empty

    def recording(self, shape, dtype):
        made.setdefault(id(self), []).append(int(torch.Size(shape).numel()) * dtype.itemsize)
        return allocate(self, shape, dtype)

    monkeypatch.setattr(tiers.HostMemory, "empty", recording)
    four_bit = CompressionConfig(4, 4) if compress else None
    policy = Policy(4, 2, TierFractions(0, 0.5, 0.5), TierFractions(0.25, 0.5, 0.25), TierFractions(0.5, 0.5, 0),
                    compress_weight=four_bit, compress_cache=four_bit)
    path, _ = tiny_model_dir("opt-post-proj")
    prompt, new = 5, 3
    with LLM(str(path), policy=policy, offload_dir=str(tmp_path), dtype="float32") as llm:
        llm.generate([[7] * prompt] * policy.block_size, SamplingParams(max_new_tokens=new, ignore_eos=True))
        cfg, dtype = llm.config, llm.dtype
    weights, block = made.values()
    assert weights == weight_host_requests(cfg, policy, dtype)
    expected = block_host_requests(cfg, policy, prompt, prompt + new, dtype.itemsize)
    assert block[:len(expected)] == expected
