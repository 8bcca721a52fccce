"""What the API hands back: a prompt's ``RequestOutput`` built from its samples' sequences, in
vLLM's shape (text without the stop that ended it, logprobs with each token's spelling), a run's
``GenerationResult`` and a continuation's ``ScoreOutput``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..runtime.batch import Sequence
from ..runtime.metrics import Metrics


@dataclass
class ScoreOutput:
    """A continuation's tokens, their log-probabilities given the prompt and what precedes them,
    and ``greedy``: whether each is its position's most likely token, so that greedy decoding from
    the prompt generates the continuation (lm-eval's is-greedy flag)."""

    token_ids: list[int]
    logprobs: list[float]
    greedy: bool = False

    @property
    def total(self) -> float:
        return sum(self.logprobs)


class GenerationResult(list):
    """The outputs in input order, with the run's metrics record."""

    def __init__(self, outputs: list[RequestOutput], metrics: Metrics):
        super().__init__(outputs)
        self.metrics = metrics


def request_output(seqs: list[Sequence], index: int, prompt, tokenizer) -> RequestOutput:
    """One prompt's output from its samples' sequences (sample 0 gives the flat fields)."""
    first = seqs[0]
    samples = [_completion(seq, j, tokenizer) for j, seq in enumerate(seqs)]
    prompt_logprobs = None
    if first.prompt_logprobs is not None:
        prompt_logprobs = [None if e is None else _logprob_dict(e, tokenizer) for e in first.prompt_logprobs]
    out = samples[0]
    return RequestOutput(
        index=index, prompt=prompt if isinstance(prompt, str) else None, prompt_token_ids=first.prompt_ids,
        text=out.text, token_ids=out.token_ids, logprobs=list(first.logprobs), finish_reason=out.finish_reason,
        error=first.error, stop_reason=out.stop_reason,
        top_logprobs=out.logprobs, prompt_logprobs=prompt_logprobs, more_outputs=samples[1:])


def _completion(seq: Sequence, sample: int, tokenizer) -> CompletionOutput:
    if seq.finish_reason == "error":
        return CompletionOutput(sample, None, [], None, None, "error")
    text = _output_text(tokenizer.decode, seq) if tokenizer is not None else None
    top = [_logprob_dict(t, tokenizer) for t in seq.top_logprobs] if seq.params.logprobs is not None else None
    return CompletionOutput(sample, text, list(seq.token_ids), math.fsum(seq.logprobs), top,
                            seq.finish_reason or "length", seq.stop_reason)


def _logprob_dict(entries, tokenizer) -> dict[int, Logprob]:
    """vLLM's logprobs of one position: the token first, then its alternatives, each with its
    token's spelling in the vocabulary."""
    texts = tokenizer.tokens([e[0] for e in entries]) if tokenizer is not None else [None] * len(entries)
    return {token: Logprob(logprob, rank, text) for (token, logprob, rank), text in zip(entries, texts)}


def _output_text(decode, seq: Sequence) -> str:
    """The generated text as vLLM gives it: a stop token (EOS or a stop token id) and the stop
    string that ended it left out, unless include_stop_str_in_output."""
    include = seq.params.include_stop_str_in_output
    ended_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
    text = decode(seq.token_ids[:-1] if ended_by_token and not include else seq.token_ids)
    stop = seq.stop_reason
    if seq.finish_reason == "stop" and isinstance(stop, str):
        # Tokens before the min_tokens-th cannot stop a sequence: a stop string ending in their text did not.
        after = len(decode(seq.token_ids[:seq.params.min_tokens - 1])) if seq.params.min_tokens > 1 else 0
        at = text.find(stop, max(0, after - len(stop) + 1))
        if at >= 0:
            text = text[:at + len(stop) if include else at]
    return text
