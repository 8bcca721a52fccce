"""What ``LLM.generate`` returns: flexoff's flat fields, and vLLM's shape (``outputs``) over the same data."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's entry in vLLM's logprobs: its log-probability under the model, its rank (1 for
    the likeliest) and its text alone (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence, as vLLM's ``CompletionOutput``."""

    index: int  # the sequence's place among its prompt's n samples
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the sampled tokens' log-probabilities; None on error
    # With SamplingParams.logprobs = k: per generated token, {token id: Logprob} of the sampled token
    # then the k likeliest (k or k + 1 entries, as vLLM); else None.
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result. The flat fields are its first sample's; ``outputs`` holds all n."""

    index: int  # position in the list given to generate()
    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each generated token under the model
    finish_reason: str  # "stop" (EOS, a stop token id or a stop string), "length", or "error"
    # Why the sequence produced no tokens (e.g. its logits turned non-finite); None when it ran.
    error: str | None = None
    stop_reason: int | str | None = None  # as CompletionOutput.stop_reason
    top_logprobs: list[dict[int, Logprob]] | None = None  # outputs[0].logprobs
    # With SamplingParams.prompt_logprobs = k: per prompt token, as CompletionOutput.logprobs (None first).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    more_outputs: list[CompletionOutput] = field(default_factory=list)  # samples 1..n-1
    # vLLM's names, derived from the fields above (so dataclasses.replace keeps them in step).
    request_id: str = field(init=False)
    outputs: list[CompletionOutput] = field(init=False)
    finished: bool = field(init=False, default=True)

    def __post_init__(self):
        self.request_id = str(self.index)
        failed = self.finish_reason == "error"
        cumulative = None if failed else math.fsum(self.logprobs)
        self.outputs = [CompletionOutput(0, self.text, self.token_ids, cumulative, self.top_logprobs,
                                         self.finish_reason, self.stop_reason), *self.more_outputs]
