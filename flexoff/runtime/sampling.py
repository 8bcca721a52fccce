"""Sampling parameters and next-token selection: greedy, or seeded temperature / top-k / top-p."""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field

import torch

from ..checks import check_bool, check_int, check_real, check_seed, is_int
from ..errors import ArgumentTypeError, SamplingError


# vLLM's parameters flexoff does not implement yet, with the value that means "off": any other
# value is refused by name rather than ignored.
NOT_YET = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
           "min_tokens": 0, "logprobs": None, "prompt_logprobs": None}


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt. ``temperature == 0`` means greedy.

    vLLM's names are accepted too: ``max_tokens`` (an alias of ``max_new_tokens``), ``top_k=-1``
    (every token), ``stop_token_ids`` and ``include_stop_str_in_output``; the defaults stay
    flexoff's (greedy, 32 new tokens)."""

    max_new_tokens: int | None = None  # None: max_tokens, else 32
    temperature: float = 0.0
    top_k: int = 0  # 0 (or vLLM's -1) keeps every token
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # Token ids that end a sequence as EOS does; the id stays in token_ids, and out of the text
    # unless include_stop_str_in_output (as vLLM does).
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token) at the end of the text
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Init-only, read back through the property below (as a _ReadBack, which dataclasses.replace
    # passes on: it yields to a new max_new_tokens instead of conflicting with it).
    max_tokens: InitVar[int | None] = None

    def __post_init__(self, max_tokens):
        if isinstance(max_tokens, _ReadBack) and self.max_new_tokens is not None:
            max_tokens = None
        if max_tokens is not None:
            check_int(max_tokens, "max_tokens", SamplingError, minimum=1)
            if self.max_new_tokens is not None and self.max_new_tokens != max_tokens:
                raise SamplingError(f"max_tokens={max_tokens!r} and max_new_tokens={self.max_new_tokens!r} "
                                    "disagree; give one of them")
            object.__setattr__(self, "max_new_tokens", max_tokens)
        elif self.max_new_tokens is None:
            object.__setattr__(self, "max_new_tokens", 32)
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise ArgumentTypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        object.__setattr__(self, "stop", tuple(stop))
        check_int(self.max_new_tokens, "max_new_tokens", SamplingError, minimum=1)
        check_real(self.temperature, "temperature", SamplingError, minimum=0)
        check_int(self.top_k, "top_k", SamplingError, minimum=-1)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        check_real(self.top_p, "top_p", SamplingError, maximum=1, above=0)
        if self.seed is not None:
            check_seed(self.seed, "seed", SamplingError)
        if any(not isinstance(s, str) for s in self.stop):
            raise ArgumentTypeError(f"stop strings must be strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must be non-empty strings")
        check_bool(self.ignore_eos, "ignore_eos")
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_int(i) and i >= 0 for i in ids):
            raise ArgumentTypeError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        check_bool(self.include_stop_str_in_output, "include_stop_str_in_output")
        check_int(self.n, "n", SamplingError, minimum=1)
        for name, off in NOT_YET.items():
            value = getattr(self, name)
            if value != off or type(value) is bool:
                raise SamplingError(f"{name}={value!r} is not supported yet (flexoff accepts only {name}={off!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class _ReadBack(int):
    """``params.max_tokens`` as read: the budget of an existing SamplingParams, not one a caller chose."""


# Set after the class: a property in its body would become the init-only argument's default.
SamplingParams.max_tokens = property(lambda self: _ReadBack(self.max_new_tokens),
                                     doc="vLLM's name for max_new_tokens")


class SequenceSampler:
    """Draws one sequence's tokens from its own generator, so a seed gives the same text whatever
    the batch it lands in."""

    def __init__(self, params: SamplingParams, default_seed: int):
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else default_seed)

    def choose(self, logits: torch.Tensor) -> int:
        """logits: (vocab,) fp32 on the CPU."""
        params = self.params
        if params.greedy:
            return int(torch.argmax(logits))
        scaled = logits / params.temperature
        if params.top_k and params.top_k < scaled.numel():
            threshold = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < threshold, -math.inf)
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (torch.cumsum(sorted_probs, 0) - sorted_probs) >= params.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def choose_tokens(samplers: list[SequenceSampler], logits: torch.Tensor) -> tuple[list[int], list[float], list[bool]]:
    """Pick the next token of each row and its log-probability under the model, and say which rows
    could be sampled at all.

    logits: (batch, vocab). The logprob is of the raw distribution (before temperature, top-k
    and top-p), which is what scoring and evaluation need. A row holding a NaN or a +inf (or only
    -inf) has no distribution: it is reported as not finite, and its token (0) means nothing.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    # Any NaN or +inf in a row makes its normaliser, so its largest logprob, non-finite: one
    # reduction over the rows already on hand.
    finite = torch.isfinite(logprobs.amax(dim=-1))
    if all(s.params.greedy for s in samplers):
        tokens = torch.where(finite, torch.argmax(logits, dim=-1), 0)
    else:
        ok = finite.tolist()
        cpu_logits = logits.cpu()
        tokens = torch.tensor([s.choose(cpu_logits[i]) if ok[i] else 0 for i, s in enumerate(samplers)],
                              device=logits.device)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    # One copy to the host for all three (token ids are exact in float64).
    tokens, chosen, ok = torch.stack([tokens.double(), chosen.double(), finite.double()]).tolist()
    return [int(t) for t in tokens], chosen, [bool(f) for f in ok]
