"""Sampling, stopping and the API's checks of its input."""

import pytest
import torch

from flexoff import LLM, SamplingParams
from flexoff.errors import PromptError, SamplingError, TokenizerError
from tests.conftest import PROMPTS


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama-gqa")[0]))


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(PROMPTS, params)]
    b = [o.token_ids for o in llm.generate(PROMPTS, params)]
    c = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(
        max_new_tokens=12, temperature=1.0, top_p=0.95, seed=8, ignore_eos=True))]
    assert a == b
    assert a != c


def test_sampling_does_not_depend_on_batch_company(llm):
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], params)[0].token_ids
    together = llm.generate(PROMPTS, params)[2].token_ids
    assert alone == together


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))
    top1 = llm.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.5, top_k=1, seed=1,
                                                ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]


def test_logprobs_are_the_models(llm):
    """Each generated token's logprob equals the model's log-probability of it given the prefix."""
    out = llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=5, temperature=1.0, seed=2,
                                                    ignore_eos=True))[0]
    scored = llm.score([out.prompt_token_ids], [out.token_ids])[0]
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(scored.logprobs), rtol=1e-4, atol=1e-5)


def test_stop_string_ends_and_trims(llm):
    free = llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    words = free.text.split()
    assert len(words) >= 3
    stop = words[2]
    first = free.text.find(stop)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:first]
    assert len(out.token_ids) < 10


def test_eos_stops_a_sequence_and_length_stops_the_rest(llm):
    probe = llm.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True))
    eos_token = probe[0].token_ids[1]  # pretend the second token is the end of sequence
    llm.config.__dict__["eos_token_ids"] = (eos_token,)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=4))
    finally:
        llm.config.__dict__["eos_token_ids"] = (2,)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids == probe[0].token_ids[:2]
    for out, ref in zip(outs, probe):
        if eos_token not in ref.token_ids:
            assert out.finish_reason == "length" and out.token_ids == ref.token_ids


@pytest.mark.parametrize("bad, error", [
    (dict(max_new_tokens=0), SamplingError),
    (dict(temperature=-1.0), SamplingError),
    (dict(top_p=0.0), SamplingError),
    (dict(top_k=-2), SamplingError),
])
def test_bad_sampling_params(bad, error):
    with pytest.raises(error):
        SamplingParams(**bad)


def test_bad_prompts(llm):
    with pytest.raises(PromptError, match="empty"):
        llm.generate([])
    with pytest.raises(PromptError, match="prompt 1 is empty"):
        llm.generate(["the cat", ""])
    with pytest.raises(PromptError, match="positions"):
        llm.generate([[5] * 60], SamplingParams(max_new_tokens=10))
    with pytest.raises(PromptError, match="vocabulary"):
        llm.generate([[5, 10_000]])


def test_text_prompt_without_tokenizer_is_refused():
    with pytest.raises(TokenizerError, match="no tokenizer"):
        LLM("opt-125m", dummy=True).generate(["hello"])
