"""A prompt's n samples share one prefill: the prefill computes each distinct prompt of a GPU batch
once, and every row's cache, first token and prompt logprobs come from it. Under every placement,
on the CPU and on CUDA, the samples are what each seed gives alone under the same policy."""

import os

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.policy import CompressionConfig
from tests.conftest import PROMPTS

N = 3
ON_CPU, ON_DISK = TierFractions(0, 1, 0), TierFractions(0, 0, 1)
SPREAD = TierFractions(0.25, 0.5, 0.25)  # batches of four: one row on the GPU, two on the CPU, one on disk


def policy(**changes) -> Policy:
    # Batches of four hold two prompts' samples, some split across batches, with their own padding.
    return Policy(**{"gpu_batch_size": 4, "num_gpu_batches": 2, **changes})


POLICIES = {
    "on-device": policy(),
    "cache-cpu": policy(cache=ON_CPU),
    "cache-disk": policy(cache=ON_DISK),
    "cache-spread": policy(cache=SPREAD),
    "cache-spread-cpu-attention": policy(cache=SPREAD, cpu_attention=True),
    "cache-compressed-cpu": policy(cache=ON_CPU, compress_cache=CompressionConfig(4, 4)),
    "activations-spread": policy(activations=SPREAD),
    "everything-off-gpu": policy(weights=TierFractions(0, 0.5, 0.5), cache=TierFractions(0, 0.5, 0.5),
                                 activations=TierFractions(0, 0.5, 0.5), cpu_attention=True),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def sampled(**changes) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True,
                             "logprobs": 2, **changes})


def open_llm(path, name: str, device: str, offload_dir) -> LLM:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return LLM(str(path), policy=POLICIES[name], device=device, dtype="float32", offload_dir=str(offload_dir))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["opt-post-proj", "llama-gqa"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_samples_sharing_a_prefill_are_each_seed_alone(tiny_model_dir, tmp_path, device, kind, name):
    path, _ = tiny_model_dir(kind)
    with open_llm(path, name, device, tmp_path) as llm:
        shared = llm.generate(PROMPTS, sampled(n=N, prompt_logprobs=1))
        # Sample j of a seeded prompt draws from seed + j: the same prompts one row each, seeded so.
        alone = [llm.generate(PROMPTS, sampled(seed=11 + j, prompt_logprobs=1)) for j in range(N)]
    assert os.listdir(tmp_path) == []
    for i, out in enumerate(shared):
        for j, completion in enumerate(out.outputs):
            reference = alone[j][i]
            assert completion.token_ids == reference.token_ids
            torch.testing.assert_close(torch.tensor([completion.logprobs[t][tok].logprob
                                                     for t, tok in enumerate(completion.token_ids)]),
                                       torch.tensor(reference.logprobs), rtol=1e-4, atol=1e-4)
            assert [list(step) for step in completion.logprobs] == [list(step) for step in reference.top_logprobs]
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        for entry, reference in zip(out.prompt_logprobs[1:], alone[0][i].prompt_logprobs[1:]):
            assert list(entry) == list(reference)
            for token in entry:
                assert entry[token].logprob == pytest.approx(reference[token].logprob, abs=1e-4)


def test_the_prefill_computes_each_prompt_once(tiny_model_dir, tmp_path):
    """Batches of n rows hold one prompt's samples each: the prefill computes each prompt once, so
    its prompt tokens are the prompts' own, unpadded; the samples still differ."""
    path, _ = tiny_model_dir("llama-gqa")
    with LLM(str(path), policy=Policy(gpu_batch_size=N, num_gpu_batches=2, cache=SPREAD),
             offload_dir=str(tmp_path)) as llm:
        result = llm.generate(PROMPTS, sampled(n=N))
        prompt_tokens = sum(len(out.prompt_token_ids) for out in result)
        assert result.metrics.prompt_tokens == result.metrics.padded_prompt_tokens == prompt_tokens
        assert all(len({tuple(c.token_ids) for c in out.outputs}) == N for out in result)


def test_identical_prompts_share_a_prefill_and_keep_their_own_settings(tiny_model_dir, tmp_path):
    """Two requests with one prompt share its prefill, whatever their sampling settings."""
    path, _ = tiny_model_dir("opt-post-proj")
    prompts = [PROMPTS[2], PROMPTS[2], PROMPTS[0]]
    params = [SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=2), sampled(),
              SamplingParams(max_tokens=5, ignore_eos=True)]
    with LLM(str(path), policy=Policy(gpu_batch_size=3, num_gpu_batches=1), offload_dir=str(tmp_path)) as llm:
        together = llm.generate(prompts, params)
        apart = [llm.generate([p], q)[0] for p, q in zip(prompts, params)]
    assert together.metrics.prompt_tokens == len(together[0].prompt_token_ids) + len(together[2].prompt_token_ids)
    for a, b in zip(together, apart):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-4, atol=1e-4)
    assert [list(e) for e in together[0].prompt_logprobs[1:]] == [list(e) for e in apart[0].prompt_logprobs[1:]]
