"""Sampling parameters and next-token selection: greedy, or seeded temperature / top-k / top-p."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..checks import check_bool, check_int, check_real, check_seed
from ..errors import ArgumentTypeError, SamplingError


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise ArgumentTypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        object.__setattr__(self, "stop", tuple(stop))
        check_int(self.max_new_tokens, "max_new_tokens", SamplingError, minimum=1)
        check_real(self.temperature, "temperature", SamplingError, minimum=0)
        check_int(self.top_k, "top_k", SamplingError, minimum=0)
        check_real(self.top_p, "top_p", SamplingError, maximum=1, above=0)
        if self.seed is not None:
            check_seed(self.seed, "seed", SamplingError)
        if any(not isinstance(s, str) for s in self.stop):
            raise ArgumentTypeError(f"stop strings must be strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must be non-empty strings")
        check_bool(self.ignore_eos, "ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
