"""The ring of two buffer sets for streamed decoder layers: a load takes the set loaded longest ago,
so loads alternate in the order they are made, whatever the layers' indices (a pipeline stage's
range of three layers wraps from its last to its first); a stage still held is not loaded again;
and every layer read from the ring is the checkpoint's."""

import pytest
import torch

from flexoff import LLM, Policy, TierFractions
from tests.conftest import build_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, ffn_dim=48,
                                     num_attention_heads=4, max_position_embeddings=64, pad_token_id=1,
                                     bos_token_id=2, eos_token_id=2))
    directory = tmp_path_factory.mktemp("opt-3")
    model.save_pretrained(directory)
    build_tokenizer(directory, "</s>", "</s>", "<pad>")
    return directory, model


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
