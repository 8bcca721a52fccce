"""The batched sampler on logits drawn here: each row's warping against transformers' warpers, the
exponential race against the distribution it samples, and a row's draws independent of its batch."""

from types import SimpleNamespace

import pytest
import torch

from flexoff import SamplingParams
from flexoff.runtime.sampler import BatchSampler

VOCAB = 40


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device(request.param)


def rows(params: list[SamplingParams], seeds=None, prompts=None):
    seeds = seeds or list(range(len(params)))
    prompts = prompts or [[1, 2]] * len(params)
    return [SimpleNamespace(params=p, seed=s, prompt_ids=ids) for p, s, ids in zip(params, seeds, prompts)]


def hf_warped(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers for one row (1, vocab), in its order (temperature, top-k, top-p, min-p)."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    for warper in warpers:
        logits = warper(None, logits)
    return logits


# One row per warper (and top-k with top-p, whose order transformers and vLLM share), in one batch.
WARPED = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
          SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.5, min_p=0.2),
          SamplingParams(temperature=2.0, top_k=12, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.5)]


def test_each_row_is_warped_as_transformers_warps_it(device):
    logits = torch.randn(len(WARPED), VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    sampler = BatchSampler(rows(WARPED), [], VOCAB, device)
    ours = sampler.warped(logits.to(device)).cpu()
    for row, params in enumerate(WARPED):
        expected = hf_warped(logits[row:row + 1].clone(), params)[0]
        assert torch.equal(torch.isfinite(ours[row]), torch.isfinite(expected)), params
        kept = torch.isfinite(expected)
        torch.testing.assert_close(ours[row][kept], expected[kept])
    kept = torch.isfinite(ours[1:]).sum(dim=-1)
    assert (kept > 1).all() and (kept < VOCAB).all()  # each warper dropped some tokens, not all but one


def test_the_exponential_race_draws_from_the_warped_distribution(device):
    """Many rows, one seed each, over the same logits: each token's frequency is its probability
    after top-k and temperature, within five standard errors."""
    count, vocab = 6000, 8
    params = SamplingParams(temperature=0.8, top_k=6)
    logits = torch.randn(1, vocab).repeat(count, 1)
    sampler = BatchSampler(rows([params] * count, seeds=list(range(count))), [], vocab, device)
    tokens = torch.tensor(sampler.choose(logits.to(device), [True] * count).tokens)
    probs = torch.softmax(hf_warped(logits[:1].clone(), params)[0], dim=-1)
    frequency = torch.bincount(tokens, minlength=vocab) / count
    error = (probs * (1 - probs) / count).sqrt()
    assert (frequency - probs).abs().le(5 * error + 1e-9).all(), (frequency, probs)
    assert frequency[probs == 0].sum() == 0


def test_a_row_draws_the_same_tokens_whatever_its_batch(device):
    params = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, presence_penalty=0.5, repetition_penalty=1.2)
    others = [SamplingParams(), SamplingParams(temperature=0.5, top_k=3), params]
    steps = [torch.randn(4, VOCAB, device=device) for _ in range(6)]
    alone = BatchSampler(rows([params], seeds=[11], prompts=[[3, 4, 5]]), [], VOCAB, device)
    together = BatchSampler(rows(others + [params], seeds=[1, 2, 3, 11], prompts=[[1], [2], [3], [3, 4, 5]]),
                            [], VOCAB, device)
    live = [True, False, True, True]  # a finished row in the batch draws nothing
    first = [alone.choose(logits[3:], [True]).tokens[0] for logits in steps]
    second = [together.choose(logits, live).tokens[3] for logits in steps]
    assert first == second


def test_greedy_rows_take_the_argmax_of_the_penalised_logits(device):
    logits = torch.randn(3, VOCAB)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(repetition_penalty=50.0)]
    top = int(logits[2].argmax())
    sampler = BatchSampler(rows(params, prompts=[[1], [1], [top]]), [], VOCAB, device)
    tokens = sampler.choose(logits.to(device), [True] * 3).tokens
    assert tokens[0] == int(logits[0].argmax())
    penalised = logits[2].clone()
    penalised[top] = penalised[top] / 50 if penalised[top] > 0 else penalised[top] * 50
    assert tokens[2] == int(penalised.argmax()) != top


def test_rows_with_non_finite_logits_are_reported_and_the_others_sampled(device):
    logits = torch.randn(3, VOCAB)
    logits[1, 5] = float("nan")
    params = [SamplingParams(temperature=1.0, frequency_penalty=1.0)] * 3
    choice = BatchSampler(rows(params), [], VOCAB, device).choose(logits.to(device), [True] * 3)
    assert choice.finite == [True, False, True]
    assert choice.tokens[1] == 0


@pytest.mark.parametrize("k", [0, 3])
def test_top_logprobs_are_the_sampled_token_then_the_k_likeliest(device, k):
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(temperature=5.0, logprobs=k), SamplingParams(temperature=5.0)]
    choice = BatchSampler(rows(params), [], VOCAB, device).choose(logits.to(device), [True, True])
    logprobs = torch.log_softmax(logits[0], dim=-1)
    token = choice.tokens[0]
    values, ids = torch.topk(logprobs, k)
    assert choice.top[1] is None
    assert [t for t, _, _ in choice.top[0]] == [token] + ids.tolist()
    assert choice.top[0][0][2] == int((logprobs >= logprobs[token]).sum())
    torch.testing.assert_close(torch.tensor([v for _, v, _ in choice.top[0]], dtype=torch.float32),
                               torch.cat([logprobs[token:token + 1], values]))
