"""Prompt logprobs and scores are made a few positions at a time, so that they take no more memory
than a head step is counted for; the chunks change no figure."""

import pytest
import torch

from flexoff import LLM, Policy, SamplingParams
from flexoff.layout import logprob_positions, sampler_step_bytes
from flexoff.runtime.engine import logprob_chunks
from tests.conftest import PROMPTS


@pytest.mark.parametrize("rows, positions, per", [(1, 1, 1), (5, 3, 7), (5, 3, 3), (4, 10, 3), (3, 9, 9), (2, 4, 100)])
def test_chunks_cover_the_grid_once_within_the_bound(rows, positions, per):
    seen = torch.zeros(rows, positions, dtype=torch.int64)
    for r, p in logprob_chunks(rows, positions, per):
        block = seen[r, p]
        assert 0 < block.numel() <= per
        seen[r, p] += 1
    assert bool((seen == 1).all())


def test_positions_fit_what_a_head_step_is_counted_for():
    vocab = 50272
    for rows, itemsize in ((1, 2), (8, 2), (64, 2), (64, 4)):
        positions = logprob_positions(rows, vocab, itemsize)
        counted = rows * vocab * itemsize + sampler_step_bytes(rows, vocab)
        # fp32 logits, their log-probabilities, the compute dtype's logits and a mask: 13 bytes an entry
        assert positions * vocab * 13 <= counted < (positions + 1) * vocab * 13


@pytest.mark.parametrize("kind", ["opt-post-proj", "llama-gqa"])
def test_chunked_prompt_logprobs_and_scores_equal_one_pass(tiny_model_dir, kind):
    path, _ = tiny_model_dir(kind)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    continuations = ["the cat sat", "on the mat and then it was happy", "a", "bird sang a song", "slowly"]
    with LLM(str(path), policy=Policy(gpu_batch_size=1, num_gpu_batches=2), dtype="float32") as small:
        assert small.engine.logprob_positions < max(len(p.split()) for p in PROMPTS)  # several chunks a prompt
        chunked = small.generate(PROMPTS, params)
        chunked_scores = small.score(PROMPTS, continuations)
    with LLM(str(path), policy=Policy(gpu_batch_size=8), dtype="float32") as whole:
        assert whole.engine.logprob_positions > max(len(p.split()) + len(c.split()) for p, c in zip(PROMPTS, continuations))
        plain = whole.generate(PROMPTS, params)
        plain_scores = whole.score(PROMPTS, continuations)
    for a, b in zip(chunked, plain):
        assert [None if e is None else list(e) for e in a.prompt_logprobs] == \
               [None if e is None else list(e) for e in b.prompt_logprobs]
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=1e-5)
    for a, b in zip(chunked_scores, plain_scores):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
