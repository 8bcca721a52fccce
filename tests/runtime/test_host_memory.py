"""Pinned host memory: the weights are registered exactly, in whole pages; a block's cache comes
in slabs. The layout lists the runtime's host allocations in its order, and reserves for them
what the runtime reserves."""

import sys

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.layout import (SlabPlan, block_host_requests, registered_bytes, slab_bytes, weight_bytes,
                            weight_host_requests)
from flexoff.policy import CompressionConfig
from flexoff.runtime import tiers

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


def test_pinned_weights_take_whole_pages_not_slabs():
    from flexoff.models import REGISTRY

    cfg = REGISTRY["opt-66b"]
    # A third of each layer on the CPU is one 679 MB matrix: a 1 GiB slab apiece would waste 36%.
    third = Policy(1, 1, TierFractions(2 / 3, 1 / 3, 0), TierFractions(1, 0, 0), TierFractions(1, 0, 0))
    requests = weight_host_requests(cfg, third, torch.float16)
    plain = weight_bytes(cfg, third, torch.float16)["cpu"]
    pinned = weight_bytes(cfg, third, torch.float16, pinned=True)["cpu"]
    assert plain == sum(requests)
    assert slab_bytes(requests) > 1.5 * plain
    assert plain <= pinned < 1.001 * plain


def test_registered_bytes_are_whole_pages():
    assert registered_bytes([1, 4096, 4097, 0]) == 4096 + 4096 + 8192 + 4096


def test_block_cache_slabs_leave_little_unused():
    from flexoff.models import REGISTRY

    cfg = REGISTRY["opt-30b"]
    policy = Policy(8, 4, TierFractions(1, 0, 0), TierFractions(0, 1, 0), TierFractions(1, 0, 0))
    requests = block_host_requests(cfg, policy, 512, 544, 2)
    # 62 MB tensors, 17 to a slab: 2% more than the cache.
    assert 1.01 * sum(requests) < slab_bytes(requests) < 1.04 * sum(requests)


@pytest.mark.gpu
def test_pinned_host_memory_is_what_the_layout_reserves(tiny_model_dir, tmp_path, monkeypatch):
    """With CUDA, the weights' registered pages and the block's slabs are the layout's figures."""
    pools: list[tiers.HostMemory] = []
    make = tiers.HostMemory.__init__

    def recording(self, *args, **kwargs):
        make(self, *args, **kwargs)
        pools.append(self)

    monkeypatch.setattr(tiers.HostMemory, "__init__", recording)
    policy = Policy(4, 2, TierFractions(0, 0.5, 0.5), TierFractions(0.25, 0.5, 0.25), TierFractions(0.5, 0.5, 0))
    path, _ = tiny_model_dir("opt-post-proj")
    prompt, new = 5, 3
    with LLM(str(path), policy=policy, offload_dir=str(tmp_path), dtype="float16", device="cuda") as llm:
        llm.generate([[7] * prompt] * policy.block_size, SamplingParams(max_new_tokens=new, ignore_eos=True))
        cfg, dtype = llm.config, llm.dtype
        weights, block = (pool for pool in pools if pool.pin)
        registered = sum(buffer.numel() for buffer in weights._registered)
        assert registered == registered_bytes(weight_host_requests(cfg, policy, dtype))
        assert weight_bytes(cfg, policy, dtype, pinned=True)["cpu"] == registered
        slabs = sum(slab.numel() for slab in block._slabs)
        assert slabs == slab_bytes(block_host_requests(cfg, policy, prompt, prompt + new, dtype.itemsize))


def _all_specs(cfg):
    from flexoff.models import stage_specs, stages

    return [spec for stage in stages(cfg) for spec in stage_specs(cfg, stage)]


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("kind", ["opt-post-proj", "qwen3-moe"])  # the latter: a dense layer among sparse ones
def test_estimates_replay_the_runtimes_host_allocations(tiny_model_dir, tmp_path, monkeypatch, compress, kind):
    """Every host allocation of the weight store and of a block, in order, as the estimates list them."""
    made: dict[int, list[int]] = {}
    allocate = tiers.HostMemory.empty

    def recording(self, shape, dtype):
        made.setdefault(id(self), []).append(int(torch.Size(shape).numel()) * dtype.itemsize)
        return allocate(self, shape, dtype)

    monkeypatch.setattr(tiers.HostMemory, "empty", recording)
    four_bit = CompressionConfig(4, 4) if compress else None
    policy = Policy(4, 2, TierFractions(0, 0.5, 0.5), TierFractions(0.25, 0.5, 0.25), TierFractions(0.5, 0.5, 0),
                    compress_weight=four_bit, compress_cache=four_bit, experts=TierFractions(0.25, 0.5, 0.25))
    path, _ = tiny_model_dir(kind)
    prompt, new = 5, 3
    with LLM(str(path), policy=policy, offload_dir=str(tmp_path), dtype="float32") as llm:
        llm.generate([[7] * prompt] * policy.block_size, SamplingParams(max_new_tokens=new, ignore_eos=True))
        cfg, dtype = llm.config, llm.dtype
    weights, block = made.values()
    assert weights == weight_host_requests(cfg, policy, dtype)
    expected = block_host_requests(cfg, policy, prompt, prompt + new, dtype.itemsize)
    assert block[:len(expected)] == expected


class _Event:
    """Stands in for a CUDA event: passed once ``done`` is set; ``synchronize`` marks the wait."""

    def __init__(self, log: list, name: str):
        self.log, self.name, self.done = log, name, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.log.append(self.name)
        self.done = True


def test_store_queue_waits_only_when_stores_hold_more_than_three_prefills():
    """Prefill-sized stores wait for the oldest beyond three in flight (what the memory estimate
    reserves); decode-sized ones never make the host wait, and finished ones are let go."""
    waited: list = []
    queue = tiers.StoreQueue()
    prefill = [_Event(waited, f"prefill{i}") for i in range(4)]
    for event in prefill[:3]:
        queue.add(event, 1000)
    assert waited == []
    queue.add(prefill[3], 1000)
    assert waited == ["prefill0"]
    prefill[1].done = prefill[2].done = prefill[3].done = True
    decode = [_Event(waited, f"decode{i}") for i in range(500)]
    for event in decode:
        queue.add(event, 5)
    assert waited == ["prefill0"]  # 500 slots of 5 bytes stay under 3 x 1000
    queue.add(_Event(waited, "big"), 1000)
    # Over 3 x 1000 again: the oldest decode stores are waited for until the rest fit.
    assert waited == ["prefill0"] + [f"decode{i}" for i in range(100)]
    assert queue.peak == 3000  # never more held than three prefills'


def test_the_store_queue_peak_counts_only_stores_not_yet_seen_to_pass():
    waited: list = []
    queue = tiers.StoreQueue()
    first, second = _Event(waited, "first"), _Event(waited, "second")
    queue.add(first, 1000)
    first.done = True
    queue.add(second, 1000)  # the first has passed: let go before the second is counted with it
    assert queue.peak == 1000 and waited == []


@pytest.mark.gpu
def test_a_travelling_caches_stores_hold_at_most_what_the_estimate_reserves(tiny_model_dir, tmp_path):
    """Prefill keys and values bound for CPU rows wait on the GPU for the store stream's copies: a run
    reports the most they held, at most the three prefills' worth the layout reserves. (On a tiny
    model each copy may pass before the next store is added, so the most held can be nothing.)"""
    policy = Policy(4, 2, TierFractions(1, 0, 0), TierFractions(0, 1, 0), TierFractions(1, 0, 0))
    path, _ = tiny_model_dir("opt-post-proj")
    prompt = 5
    with LLM(str(path), policy=policy, offload_dir=str(tmp_path), dtype="float16", device="cuda") as llm:
        result = llm.generate([[7] * prompt] * policy.block_size, SamplingParams(max_new_tokens=3, ignore_eos=True))
        cfg = llm.config
    one_prefill = 2 * policy.gpu_batch_size * prompt * cfg.num_kv_heads * cfg.head_dim * 2  # keys and values, fp16
    assert 0 <= result.metrics.peak_memory["gpu_store_stream_peak"] <= 3 * one_prefill


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            start, stop = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < stop
        elif inside and fields[0] == "VmFlags:":
            return fields[1:]
    return []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")
def test_advised_buffers_are_marked_for_huge_pages():
    # "hg": the kernel backs the mapping with huge pages where it can. Whether it could depends on
    # the machine's free memory at the time, so that is not what is asserted.
    buffer = tiers.touched_pages(64 * MiB)
    assert buffer.data_ptr() % tiers.HUGE_PAGE == 0 and buffer.numel() == 64 * MiB
    assert "hg" in _mapping_flags(buffer.data_ptr())


@pytest.mark.gpu
def test_large_registrations_are_huge_page_aligned_and_zeroed():
    memory = tiers.HostMemory(pin=True, exact=True)
    try:
        large = memory.empty((40 * MiB + 3,), torch.uint8)
        small = memory.empty((3 * MiB,), torch.uint8)
        large_buffer, small_buffer = memory._registered
        assert large_buffer.data_ptr() % tiers.HUGE_PAGE == 0 and large.data_ptr() == large_buffer.data_ptr()
        assert small_buffer.data_ptr() % tiers.PAGE == 0
        assert large_buffer.numel() == 40 * MiB + tiers.PAGE and small_buffer.numel() == 3 * MiB
        assert not large.any() and not small.any()
        device = large.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert not device.any()
    finally:
        memory.close()
