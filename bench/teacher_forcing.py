"""Perplexity by teacher-forced decoding through the engine's block API, for bench/accuracy.py and
the accuracy tests.

``LLM.score`` is one prefill, which attends on the fresh keys and values: a compressed cache never
shows there. Here a short prompt is prefilled and every later true token is fed back as if it had
been sampled, so each decode step gives the log-probability of the true next token given every
true token before it, the earlier ones read from the (compressed) cache. That needs the engine's
block API, below ``LLM``: the batch's sampler is replaced for the block by one that always picks
each row's next true token.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from unittest import mock

import torch

from flexoff.runtime import engine as engine_module
from flexoff.runtime.batch import Sequence
from flexoff.runtime.sampler import Choice
from flexoff.runtime.sampling import SamplingParams


class TeacherForcing:
    """Stands in for a batch's sampler and always picks each row's next true token.

    The engine feeds each chosen token back as the next input and records its log-probability
    under the model's raw distribution, which is what perplexity needs.
    """

    def __init__(self, targets: dict[int, list[int]], seqs):
        self.targets = [targets[seq.index] for seq in seqs]
        self.step = 0

    def choose(self, logits: torch.Tensor, live) -> Choice:
        tokens = torch.tensor([target[self.step] for target in self.targets], device=logits.device)
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None])[:, 0]
        self.step += 1
        return Choice(tokens.tolist(), logprobs.tolist(), [True] * len(self.targets))


def decode_logprobs(llm, prompts: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
    """Each target token's log-probability, decoded one by one after its prompt (one block)."""
    seqs = [Sequence(index, prompt, SamplingParams(max_new_tokens=len(target), ignore_eos=True), 0)
            for index, (prompt, target) in enumerate(zip(prompts, targets))]
    by_index = dict(enumerate(targets))
    with mock.patch.object(engine_module, "BatchSampler", lambda seqs, *_: TeacherForcing(by_index, seqs)):
        llm.engine.generate_block(seqs)
    for seq, target in zip(seqs, targets):
        if seq.token_ids != target:  # every true token was fed back, none sampled
            raise RuntimeError(f"teacher forcing fed {len(seq.token_ids)} tokens of {len(target)}")
    return [seq.logprobs for seq in seqs]


def perplexity(logprobs: list[list[float]]) -> float:
    flat = [value for row in logprobs for value in row]
    return math.exp(-sum(flat) / len(flat))


@contextmanager
def one_thread():
    """Run torch on one thread. A small model's matmuls gain little from a second core, and when
    other processes share the machine, two threads wait on each other: training and decoding then
    ran ten to twenty times slower (measured on two cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
