"""The weights of a pipeline stage's range of stages: the layout counts, and the weight store
places, exactly those stages' pieces, with buffers for the kinds the range runs (a ring of two only
where it runs more than one decoder layer), and each stage reads as in the whole model."""

import itertools

import pytest
import torch

from flexoff import LLM, Policy, TierFractions
from flexoff.layout import buffer_copies, owned_stages, weight_bytes, weight_layout
from flexoff.models import REGISTRY, stages
from flexoff.models.config import ModelConfig
from flexoff.policy import CompressionConfig
from flexoff.runtime.tiers import Streams
from flexoff.runtime.weight_store import TieredWeights
from flexoff.weights.checkpoint import CheckpointWeights
from tests.runtime.test_weight_ring import three_layers  # noqa: F401  (a fixture)

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


def test_the_store_places_only_its_ranges_stages_and_reads_them_as_the_whole_model(three_layers):  # noqa: F811
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
