"""The ring of two buffer sets for streamed decoder layers: a load takes the set loaded longest ago,
so loads alternate in the order they are made, whatever the layers' indices (a pipeline stage's
range of three layers wraps from its last to its first); a stage still held is not loaded again;
and every layer read from the ring is the checkpoint's."""

import pytest
import torch

from flexoff import LLM, Policy, TierFractions

pytest.importorskip("transformers")


def test_loads_alternate_in_order_and_read_the_checkpoints_layers(three_layers):
    directory, model = three_layers
    policy = Policy(2, 1, weights=TierFractions(0, 1, 0))  # every layer streamed from host memory
    with LLM(str(directory), policy=policy, device="cpu", dtype="float32") as llm:
        weights, layers = llm.engine.weights, llm.engine.stages[1:-1]
        previous = None
        for stage in layers * 3:  # three tokens of a range of three layers
            weights.prefetch(stage)
            buffer = weights._set_for(stage)
            assert buffer is not previous, f"{stage.name} loaded over the stage loaded just before it"
            previous = buffer
            fc1 = weights.get(stage)["fc1.weight"]
            torch.testing.assert_close(fc1, model.model.decoder.layers[stage.index].fc1.weight.detach())
            weights.release(stage)


def test_a_stage_still_held_is_not_loaded_again(three_layers):
    directory, _ = three_layers
    policy = Policy(2, 1, weights=TierFractions(0, 1, 0))
    with LLM(str(directory), policy=policy, device="cpu", dtype="float32") as llm:
        weights, stage = llm.engine.weights, llm.engine.stages[2]
        weights.prefetch(stage)
        loaded = weights._set_for(stage).loaded
        weights.release(stage)
        weights.prefetch(stage)  # a range of one layer loads it every token
        assert weights._set_for(stage).loaded == loaded
