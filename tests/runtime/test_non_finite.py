"""A sequence whose logits turn NaN or infinite ends with an error naming the weight at fault; the
other sequences of its block go on and equal the run of a healthy model."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.errors import NonFiniteError
from tests.conftest import PROMPTS, assert_same_outputs, generate

WORD = "moon"  # in one prompt only
POISONED = [i for i, p in enumerate(PROMPTS) if WORD in p.split()]
HALVES = TierFractions(0, 0.5, 0.5)
POLICIES = {
    "on device": Policy(gpu_batch_size=8),
    "offloaded": Policy(gpu_batch_size=3, num_gpu_batches=2, weights=HALVES, cache=HALVES, activations=HALVES,
                        cpu_attention=True),
}
PARAMS = {
    "greedy": SamplingParams(max_new_tokens=6, ignore_eos=True),
    "sampled": SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3),
}


@pytest.fixture(scope="module", params=[math.nan, math.inf], ids=["nan", "inf"])
def poisoned(request, tiny_model_dir, tmp_path_factory):
    """(healthy model, a copy whose input embedding of WORD is NaN or infinite, WORD's id). The
    model's output head is its own matrix, so only prompts holding WORD are poisoned."""
    healthy, _ = tiny_model_dir("llama-gqa")
    path = tmp_path_factory.mktemp("poisoned") / "model"
    shutil.copytree(healthy, path)
    token = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"][WORD]
    tensors = load_file(path / "model.safetensors")
    tensors["model.embed_tokens.weight"][token, 3] = request.param
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return healthy, path, token


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_poisoned_sequence_fails_alone(poisoned, policy, params, tmp_path):
    healthy, path, token = poisoned
    ref = generate(healthy, POLICIES["on device"], params=PARAMS[params])
    assert POISONED and all(token not in r.token_ids for r in ref)  # the others never meet the poison
    outs = generate(path, POLICIES[policy], tmp_path, params=PARAMS[params])
    for i in POISONED:
        out = outs[i]
        assert (out.finish_reason, out.token_ids, out.logprobs, out.text) == ("error", [], [], None)
        assert out.error.startswith("the logits turned non-finite at generated token 1: ")
        assert "weight embed_tokens.weight of embed holds NaN or infinite values" in out.error
    healthy_rows = [i for i in range(len(PROMPTS)) if i not in POISONED]
    assert all(outs[i].error is None for i in healthy_rows)
    assert_same_outputs([outs[i] for i in healthy_rows], [ref[i] for i in healthy_rows])


def test_scores_and_logits_refuse_non_finite_values(poisoned):
    _, path, _ = poisoned
    with LLM(str(path)) as llm:
        with pytest.raises(NonFiniteError, match=f"prompt {POISONED[0]}: .*embed_tokens.weight of embed"):
            llm.next_token_logits(PROMPTS)
        with pytest.raises(NonFiniteError, match=f"prompt {POISONED[0]}: .*embed_tokens.weight of embed"):
            llm.score(PROMPTS, ["the cat"] * len(PROMPTS))
        healthy = [p for i, p in enumerate(PROMPTS) if i not in POISONED]
        assert torch.isfinite(llm.next_token_logits(healthy)).all()
