"""Rows of a GPU batch that begin alike share that prefix: its prefill runs once, its cache is held
once, and each row attends over it and over its own tokens, merged by log-sum-exp. Under every
placement, compression, CPU attention and family, on the CPU and on CUDA, the outputs are those of
the same job with sharing off."""

import os
import random

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.policy import CompressionConfig
from flexoff.prefixes import MIN_SHARED_PREFIX
from tests.conftest import assert_same_outputs

ON_CPU, ON_DISK = TierFractions(0, 1, 0), TierFractions(0, 0, 1)
SPREAD = TierFractions(0.25, 0.5, 0.25)  # batches of four: one row on the GPU, two on the CPU, one on disk
HALF = TierFractions(0.5, 0.5, 0)


def policy(**changes) -> Policy:
    return Policy(**{"gpu_batch_size": 4, "num_gpu_batches": 2, **changes})


POLICIES = {
    "on-device": policy(),
    "one-batch": policy(num_gpu_batches=1, gpu_batch_size=8),
    "cache-cpu": policy(cache=ON_CPU),
    "cache-disk": policy(cache=ON_DISK),
    "cache-spread": policy(cache=SPREAD),
    "cache-cpu-attention": policy(cache=ON_CPU, cpu_attention=True),
    "cache-disk-cpu-attention": policy(cache=ON_DISK, cpu_attention=True),
    "cache-spread-cpu-attention": policy(cache=SPREAD, cpu_attention=True),
    "cache-compressed-gpu": policy(compress_cache=CompressionConfig(4, 4)),
    "cache-compressed-spread": policy(cache=SPREAD, compress_cache=CompressionConfig(4, 4)),
    "cache-compressed-cpu-attention": policy(cache=HALF, cpu_attention=True, compress_cache=CompressionConfig(4, 4)),
    "activations-spread": policy(activations=SPREAD),
    "everything-off-gpu": policy(weights=TierFractions(0, 0.5, 0.5), cache=TierFractions(0, 0.5, 0.5),
                                 activations=TierFractions(0, 0.5, 0.5), cpu_attention=True),
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def few_shot(seed: int = 0, subjects: int = 3, questions: int = 3) -> list[list[int]]:
    """Subjects of questions that share their subject's in-context examples, each a head of
    MIN_SHARED_PREFIX + 6 ids, then a question of its own of 1 to 7 ids."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(subjects):
        head = [rng.randrange(4, 60) for _ in range(MIN_SHARED_PREFIX + 6)]
        prompts += [head + [rng.randrange(4, 60) for _ in range(rng.randrange(1, 8))] for _ in range(questions)]
    return prompts


def open_llm(path, name: str, device: str, offload_dir, share: bool) -> LLM:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return LLM(str(path), policy=POLICIES[name], device=device, dtype="float32", offload_dir=str(offload_dir),
               prefix_sharing=share)


def both(path, name, device, offload_dir, prompts, params):
    """(shared, unshared) outputs and the shared run's metrics."""
    runs = []
    for share in (True, False):
        with open_llm(path, name, device, offload_dir, share) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            runs.append((outs, outs.metrics))
    assert os.listdir(offload_dir) == []
    return runs[0][0], runs[1][0], runs[0][1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["opt-post-proj", "llama-gqa"])
@pytest.mark.parametrize("name", list(POLICIES))
def test_shared_prefixes_give_the_unshared_outputs(tiny_model_dir, tmp_path, device, kind, name):
    path, _ = tiny_model_dir(kind)
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1)
    shared, alone, metrics = both(path, name, device, tmp_path, few_shot(), params)
    assert metrics.shared_prompt_tokens > 0
    assert_same_outputs(shared, alone)


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen3-qk-norm", "mixtral", "qwen2-moe"])
def test_every_family_shares(tiny_model_dir, tmp_path, kind):
    path, _ = tiny_model_dir(kind)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
    shared, alone, metrics = both(path, "cache-spread", "cpu", tmp_path, few_shot(1), params)
    assert metrics.shared_prompt_tokens > 0
    assert_same_outputs(shared, alone)


def shared_and_alone(path, name, device, offload_dir, run):
    """``run(llm)`` with sharing on, then off."""
    results = []
    for share in (True, False):
        with open_llm(path, name, device, offload_dir, share) as llm:
            results.append(run(llm))
    assert os.listdir(offload_dir) == []
    return results


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["cache-spread", "cache-spread-cpu-attention"])
def test_seeded_samples_and_stop_strings(tiny_model_dir, tmp_path, device, name):
    """n seeded samples of one prompt share its prompt's cache; stop strings end rows as alone."""
    path, _ = tiny_model_dir("llama-gqa")
    prompts = [{"prompt_token_ids": p} for p in few_shot(2, questions=3)]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3, logprobs=1, stop=["the"])

    def run(llm):
        outs = llm.generate(prompts, params)
        return outs, [[(c.token_ids, c.finish_reason, [next(iter(step.values())).logprob for step in c.logprobs])
                       for c in out.outputs] for out in outs]

    (shared, got), (_, expected) = shared_and_alone(path, name, device, tmp_path, run)
    assert shared.metrics.shared_prompt_tokens > 0
    for rows, reference in zip(got, expected):
        for (tokens, reason, logprobs), (ref_tokens, ref_reason, ref_logprobs) in zip(rows, reference):
            assert (tokens, reason) == (ref_tokens, ref_reason)
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), rtol=0, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_a_contexts_choices_share_its_prefill(tiny_model_dir, tmp_path, device):
    """Scores of four continuations of each context, as a multiple-choice evaluation asks them."""
    path, _ = tiny_model_dir("opt-post-proj")
    contexts = few_shot(3, subjects=2, questions=1)
    rng = random.Random(4)
    choices = [[rng.randrange(4, 60) for _ in range(rng.randrange(1, 4))] for _ in range(8)]
    prompts = [contexts[i // 4] for i in range(8)]
    shared, alone = shared_and_alone(path, "cache-cpu", device, tmp_path,
                                     lambda llm: llm.score(prompts, choices))
    for mine, reference in zip(shared, alone):
        assert mine.token_ids == reference.token_ids
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(reference.logprobs), rtol=0, atol=1e-4)


def test_a_decode_step_moves_the_prefix_once(tiny_model_dir, tmp_path, monkeypatch):
    """Bytes a travelling cache's loads move: with sharing, each batch's prefix once per step and
    layer, not once per row."""
    from flexoff.runtime.kv import BatchKV

    moved = []
    copy_in = BatchKV._copy_in

    def counting(self, groups, layer, start, index, first):
        moved[-1] += sum(start * (g.rows.stop - g.rows.start) for g in groups)  # slots, over rows
        copy_in(self, groups, layer, start, index, first)

    monkeypatch.setattr(BatchKV, "_copy_in", counting)
    path, _ = tiny_model_dir("llama-gqa")
    prompts = [{"prompt_token_ids": p} for p in few_shot(5, subjects=1, questions=8)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for share in (True, False):
        moved.append(0)
        with open_llm(path, "cache-cpu", "cpu", tmp_path, share) as llm:
            outs = llm.generate(prompts, params)
            layers = llm.config.num_layers
    prefix = MIN_SHARED_PREFIX + 6
    rows, batches = 4, 2
    steps = params.max_tokens - 1
    # Per batch, layer and decode step, unshared rows each move the prefix; shared, one copy does.
    assert moved[1] - moved[0] == (rows - 1) * prefix * batches * layers * steps
    assert outs.metrics.shared_prompt_tokens == 0
