"""What a pipeline stage's range of stages holds: the layout counts, and the weight store places,
exactly those stages' weights, with buffers for the kinds the range runs (a ring of two only where
it runs more than one decoder layer), each stage reading as in the whole model; and the caches of
its decoder layers only."""

import itertools

import pytest
import torch

from flexoff import LLM, Policy, TierFractions
from flexoff.layout import (block_disk_files, block_host_requests, buffer_copies, kv_cache_bytes, owned_layers,
                            owned_stages, weight_bytes, weight_layout)
from flexoff.models import REGISTRY, stages
from flexoff.models.config import ModelConfig
from flexoff.policy import CompressionConfig
from flexoff.runtime.kv import BatchKV, BlockKV
from flexoff.runtime.tiers import HostMemory, Streams
from flexoff.runtime.weight_store import TieredWeights
from flexoff.weights.checkpoint import CheckpointWeights

FOUR_BIT = CompressionConfig(4, 64)
POLICIES = {
    "fp16 20/70/10": Policy(8, 2, weights=TierFractions(0.2, 0.7, 0.1)),
    "4-bit 0/100": Policy(8, 2, weights=TierFractions(0, 1, 0), compress_weight=FOUR_BIT, compress_cache=FOUR_BIT),
}


def ranges(num_stages: int, devices: int):
    for cuts in itertools.combinations(range(1, num_stages), devices - 1):
        edges = (0, *cuts, num_stages)
        yield [range(a, b) for a, b in zip(edges, edges[1:])]


def small(name: str) -> ModelConfig:
    return REGISTRY[name].replace(num_layers=4)


@pytest.mark.parametrize("name", ["opt-1.3b", "llama-3-8b", "mixtral-8x7b"])
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_a_ranges_layout_is_its_stages_share_of_the_whole(name, policy):
    cfg = small(name)
    whole = weight_layout(cfg, policy, torch.float16)
    for split in itertools.chain(ranges(len(stages(cfg)), 2), ranges(len(stages(cfg)), 3)):
        stored = dict.fromkeys(("gpu", "cpu", "disk"), 0)
        for owned in split:
            part = weight_layout(cfg, policy, torch.float16, owned)
            assert list(part.stage_tiers) == owned_stages(cfg, owned)
            for stage, sizes in part.stage_tiers.items():
                assert sizes == whole.stage_tiers[stage]
                for tier in stored:
                    stored[tier] += sizes[tier]
            assert set(part.buffers) == {stage.kind for stage in owned_stages(cfg, owned)} & set(whole.buffers)
            layers = sum(stage.kind == "layer" for stage in owned_stages(cfg, owned))
            assert buffer_copies(cfg, "layer", owned) == (2 if layers > 1 else 1)
        assert stored == {tier: sum(s[tier] for s in whole.stage_tiers.values()) for tier in stored}


def test_the_store_places_only_its_ranges_stages_and_reads_them_as_the_whole_model(three_layers):
    directory, model = three_layers
    policy = Policy(2, 1, weights=TierFractions(0.3, 0.7, 0))
    with LLM(str(directory), policy=policy, device="cpu", dtype="float32") as llm:
        cfg, every = llm.config, llm.engine.stages
        for owned in (range(0, 2), range(2, 3), range(3, 5)):
            part = TieredWeights(cfg, CheckpointWeights(directory), policy, torch.device("cpu"), torch.float32,
                                 Streams(torch.device("cpu"), True), None, owned)
            try:
                assert list(part.placements) == every[owned.start:owned.stop]
                expected = weight_bytes(cfg, policy, torch.float32, owned=owned)
                stored = sum(sizes["gpu"] for sizes in weight_layout(cfg, policy, torch.float32, owned).stage_tiers.values())
                assert part.bytes["gpu"] == stored and part.bytes["cpu"] == expected["cpu"]
                for stage in every[owned.start:owned.stop]:
                    part.prefetch(stage)
                    mine, theirs = part.get(stage), llm.engine.weights.get(stage)
                    assert set(mine) == set(theirs)
                    for name in mine:
                        torch.testing.assert_close(mine[name], theirs[name])
                    part.release(stage)
                    llm.engine.weights.release(stage)
            finally:
                part.close()


@pytest.mark.parametrize("cache", [TierFractions(0, 1, 0), TierFractions(0.25, 0.5, 0.25)], ids=["cpu", "split"])
def test_a_ranges_caches_are_its_layers_share(cache):
    cfg, slots = small("opt-1.3b"), 40
    policy = Policy(8, 2, cache=cache)
    whole_files = block_disk_files(cfg, policy, 32, slots, 2)
    for split in ranges(len(stages(cfg)), 3):
        layers = [owned_layers(cfg, owned) for owned in split]
        assert sum(layers, []) == list(range(cfg.num_layers))
        files = [block_disk_files(cfg, policy, 32, slots, 2, owned) for owned in split]
        assert sorted(sum(files, [])) == sorted(whole_files)
        host = [block_host_requests(cfg, policy, 32, slots, 2, owned) for owned in split]
        whole_host = block_host_requests(cfg, policy, 32, slots, 2)
        # The rows on the host, per layer: the ranges together hold the whole model's.
        per_layer = sum(whole_host) - sum(sum(h) for h in host)
        staging_pairs = len(split) - 1  # each device stages its disk rows through host pairs of its own
        assert per_layer == -staging_pairs * sum(_staging(cfg, policy, slots))


def _staging(cfg, policy, slots):
    from flexoff.layout import kv_buffer_parts, split_rows
    from flexoff.layout.block import DISK_HOST_PAIRS, DISK_SLOT_RING

    def pair(p, n):
        return 2 * sum(kv_buffer_parts(cfg, n, p.stop - p.start, None, 2))

    return [(DISK_HOST_PAIRS * pair(p, slots) + DISK_SLOT_RING * pair(p, 1)) * policy.num_gpu_batches
            for p in split_rows(policy.gpu_batch_size, policy.cache) if p.tier == "disk"]


def test_the_caches_of_a_range_hold_its_layers_only(three_layers, tmp_path):
    directory, _ = three_layers
    policy = Policy(2, 1, cache=TierFractions(0, 0.5, 0.5))
    with LLM(str(directory), policy=policy, device="cpu", dtype="float32", offload_dir=str(tmp_path)) as llm:
        engine, cfg = llm.engine, llm.config
        owned = range(2, 5)  # layers 1 and 2, and the head
        host = HostMemory(False)
        block = BlockKV(cfg, policy, engine.device, torch.float32, engine.streams, host, engine.disk, engine.worker,
                        None, layers=tuple(owned_layers(cfg, owned)))
        kv = BatchKV(block, 2, 12, "b0")
        assert [sorted(g.store) if g.tier == "cpu" else sorted(g.files) for g in kv.groups] == [[1, 2], [1, 2]]
        held = {tier: sum(g.nbytes_by_tier().get(tier, 0) for g in kv.groups) for tier in ("cpu", "disk")}
        expected = kv_cache_bytes(cfg, policy, 12, 4, owned)
        assert held["cpu"] == expected["cpu"]
        assert held["disk"] == expected["disk"]
