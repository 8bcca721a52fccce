"""Sampling parameters: how to continue one prompt, checked on construction (the batched choice of
tokens is in sampler.py)."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

from ..checks import check_bool, check_int, check_real, check_seed, is_int
from ..errors import ArgumentTypeError, SamplingError


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt. ``temperature == 0`` means greedy.

    vLLM's names are accepted too, with vLLM's meaning: ``max_tokens`` (an alias of
    ``max_new_tokens``), ``top_k=-1`` (every token), ``n`` samples per prompt, the presence,
    frequency and repetition penalties, ``min_p``, ``min_tokens``, ``stop_token_ids``,
    ``include_stop_str_in_output``, ``logprobs`` and ``prompt_logprobs``; the defaults stay
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
    n: int = 1  # samples per prompt; sample j of a seeded prompt draws from seed + j (as vLLM)
    # vLLM's (and OpenAI's) penalties: presence and frequency subtract from the logits of tokens
    # already generated (once, or once per occurrence); repetition divides positive logits (and
    # multiplies negative ones) of tokens in the prompt or generated, as transformers does.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p times the likeliest one
    min_tokens: int = 0  # no stop (EOS, stop token ids, stop strings) before this many tokens
    logprobs: int | None = None  # per generated token: the sampled token and this many top alternatives
    prompt_logprobs: int | None = None  # the same per prompt token (the first has none)
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
        check_real(self.presence_penalty, "presence_penalty", SamplingError, minimum=-2, maximum=2)
        check_real(self.frequency_penalty, "frequency_penalty", SamplingError, minimum=-2, maximum=2)
        check_real(self.repetition_penalty, "repetition_penalty", SamplingError, above=0)
        check_real(self.min_p, "min_p", SamplingError, minimum=0, maximum=1)
        check_int(self.min_tokens, "min_tokens", SamplingError, minimum=0)
        if self.min_tokens > self.max_new_tokens:
            raise SamplingError(f"min_tokens={self.min_tokens} is more than max_tokens={self.max_new_tokens}")
        # Their bound above is the model's vocabulary, which LLM.generate checks.
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, SamplingError, minimum=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class _ReadBack(int):
    """``params.max_tokens`` as read: the budget of an existing SamplingParams, not one a caller chose."""


# Set after the class: a property in its body would become the init-only argument's default.
SamplingParams.max_tokens = property(lambda self: _ReadBack(self.max_new_tokens),
                                     doc="vLLM's name for max_new_tokens")
