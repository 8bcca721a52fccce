"""The next token of every row of a GPU batch, chosen on the device in one pass over the batch.

Each row's parameters are a tensor over the rows, in vLLM's order: stop tokens masked until
``min_tokens``, then the repetition, frequency and presence penalties; greedy rows take the argmax
there. Sampled rows then go through temperature, min-p, top-k and top-p, and draw by an
exponential race (the argmax of probability / Exp(1) noise is a draw from the distribution). The
noise is the only work per row: each row draws it from its own seeded generator, a full row per
step, so a seed gives the same text whatever batch it lands in.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from ..layout import SORTED_ROWS

# A token's log-probability under the model and its rank (1 for the likeliest), as vLLM's Logprob.
Ranked = tuple[int, float, int]


@dataclass
class Choice:
    """What one head step chose, per row, on the host."""

    tokens: list[int]
    logprobs: list[float]  # of the raw distribution (before penalties and warping), as vLLM's default
    finite: list[bool]  # False: the row's logits hold a NaN or +inf, and its token means nothing
    top: list[list[Ranked]] | None = None  # per row asking: the chosen token, then the top alternatives


class BatchSampler:
    """Chooses tokens for the rows of one GPU batch, which all advance one token per step.

    ``seqs``: the rows, each with ``params`` (SamplingParams), ``seed`` and ``prompt_ids``.

    Its device memory is what :mod:`flexoff.layout.head` counts: the per-row state below for the
    whole block, and at each step fp32 tensors over (rows, vocab), changed in place where the
    sampler owns them, and a sort of at most ``SORTED_ROWS`` rows at a time.
    """

    def __init__(self, seqs: SequenceOf, eos_ids: SequenceOf[int], vocab_size: int, device: torch.device):
        params = [s.params for s in seqs]
        self.rows, self.vocab, self.device = len(params), vocab_size, device
        self.step = 0
        self.logprobs_asked = [p.logprobs for p in params]
        self.logprobs_k = max((k for k in self.logprobs_asked if k is not None), default=None)

        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)[:, None]

        self.greedy = column([p.greedy for p in params], torch.bool)[:, 0]
        self.all_greedy = all(p.greedy for p in params)
        self.temperature = column([1.0 if p.greedy else p.temperature for p in params])
        self.min_p = column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None
        # top_k 0 keeps every token, as the vocabulary's size (or more) does.
        keep = [min(p.top_k or vocab_size, vocab_size) for p in params]
        self.top_k_keep = column(keep, torch.long) if any(0 < p.top_k < vocab_size for p in params) else None
        self.top_k_max = max(keep, default=0)
        self.top_p = column([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None
        self.generators = [None if p.greedy else torch.Generator(device).manual_seed(s.seed)
                           for p, s in zip(params, seqs)]
        # min_tokens: each row's stop ids (EOS unless ignored, and its stop token ids), masked while
        # it has produced fewer than min_tokens; kept as ids (rows, most ids), not a vocabulary mask.
        self.min_tokens = None
        if any(p.min_tokens for p in params):
            stops = [[i for i in (() if p.ignore_eos else tuple(eos_ids)) + p.stop_token_ids if i < vocab_size]
                     for p in params]
            width = max(len(ids) for ids in stops) or 1
            # Rows pad with their own first id (a repeat writes the same value) or, without any, with
            # id 0 left as it is.
            self.stop_ids = torch.tensor([ids + [ids[0] if ids else 0] * (width - len(ids)) for ids in stops],
                                         dtype=torch.long, device=device)
            self.min_tokens = column([p.min_tokens if ids else 0 for p, ids in zip(params, stops)], torch.long)
        self.repetition = column([p.repetition_penalty for p in params]) \
            if any(p.repetition_penalty != 1 for p in params) else None
        self.frequency = column([p.frequency_penalty for p in params]) \
            if any(p.frequency_penalty for p in params) else None
        self.presence = column([p.presence_penalty for p in params]) \
            if any(p.presence_penalty for p in params) else None
        # Output token counts per row (rows, vocab) for the frequency and presence penalties, and the
        # tokens seen (prompt or output) for the repetition penalty.
        self.counts = (torch.zeros(self.rows, vocab_size, dtype=torch.int32, device=device)
                       if self.frequency is not None or self.presence is not None else None)
        self.seen = None
        if self.repetition is not None:
            self.seen = torch.zeros(self.rows, vocab_size, dtype=torch.bool, device=device)
            for row, seq in enumerate(seqs):
                ids = [i for i in seq.prompt_ids if i < vocab_size]
                if ids:
                    self.seen[row, torch.tensor(ids, device=device)] = True
        self.adjusts = self.min_tokens is not None or self.repetition is not None or self.counts is not None

    def __len__(self) -> int:
        return self.rows

    def adjust_(self, logits: torch.Tensor) -> torch.Tensor:
        """In place, the logits greedy rows take the argmax of: stop tokens masked under min_tokens,
        then the penalties, as vLLM's formulas. logits: (rows, vocab) fp32."""
        if self.min_tokens is not None:
            held = self.step < self.min_tokens
            stops = logits.gather(1, self.stop_ids)
            logits.scatter_(1, self.stop_ids, stops.masked_fill_(held, -torch.inf))
        if self.repetition is not None:
            # Seen tokens' positive logits are divided by the penalty, the others multiplied by it;
            # by 1.0 elsewhere, which leaves them exactly as they are.
            positive = logits > 0
            logits.div_(torch.where(self.seen & positive, self.repetition, 1.0))
            logits.mul_(torch.where(self.seen > positive, self.repetition, 1.0))
            del positive
        # The counts made fp32 first, then scaled in place: one fp32 temporary, not two.
        if self.frequency is not None:
            logits.sub_(self.counts.float().mul_(self.frequency))
        if self.presence is not None:
            logits.sub_((self.counts > 0).float().mul_(self.presence))
        return logits

    def warped(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampled rows' logits after temperature, min-p, top-k and top-p (dropped tokens at -inf)."""
        return self.warp_(logits.clone())

    def warp_(self, logits: torch.Tensor) -> torch.Tensor:
        """``warped``, in place."""
        logits.div_(self.temperature)
        if self.min_p is not None:
            probs = torch.softmax(logits, dim=-1)
            dropped = probs < self.min_p * probs.amax(dim=-1, keepdim=True)
            del probs
            logits.masked_fill_(dropped, -torch.inf)
        if self.top_k_keep is not None or self.top_p is not None:
            # A sort takes 12 bytes per entry, and its scratch more: a few rows at a time bound them.
            for start in range(0, self.rows, SORTED_ROWS):
                self._truncate_(logits[start:start + SORTED_ROWS], slice(start, start + SORTED_ROWS))
        return logits

    def _truncate_(self, logits: torch.Tensor, rows: slice) -> None:
        """Top-k, then top-p, in place on some rows' logits."""
        keep = None if self.top_k_keep is None else self.top_k_keep[rows]
        if self.top_p is None:  # top-k alone needs only each row's k-th value, not a sort
            kth = torch.topk(logits, self.top_k_max, dim=-1).values.gather(1, keep - 1)
            logits.masked_fill_(logits < kth, -torch.inf)  # ties with the k-th token stay
            return
        values, order = torch.sort(logits, dim=-1, descending=True)
        if keep is not None:
            values.masked_fill_(values < values.gather(1, keep - 1), -torch.inf)
        probs = torch.softmax(values, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays). The mass
        # before each token goes where the logits were: the scatter below overwrites all of them.
        before = torch.cumsum(probs, dim=-1, out=logits).sub_(probs)
        del probs
        values.masked_fill_(before >= self.top_p[rows], -torch.inf)
        logits.scatter_(1, order, values)

    def choose(self, logits: torch.Tensor, live: SequenceOf[bool]) -> Choice:
        """The next token of each row; ``live`` says which rows still generate (the others draw no
        noise, so that a row's draws are its own). logits: (rows, vocab), left as they are."""
        work = logits.float()
        logprobs = torch.log_softmax(work, dim=-1)
        # Any NaN or +inf in a row makes its normaliser, so its largest logprob, non-finite.
        finite = torch.isfinite(logprobs.amax(dim=-1))
        if work is logits and (self.adjusts or not self.all_greedy):
            work = work.clone()  # fp32 logits are the caller's
        tokens = torch.argmax(self.adjust_(work), dim=-1)
        probs = None if self.all_greedy else torch.softmax(self.warp_(work), dim=-1)
        del work  # before the noise is allocated
        if probs is not None:
            noise = torch.ones_like(probs)
            for row, generator in enumerate(self.generators):
                if generator is not None and live[row]:
                    noise[row].exponential_(generator=generator)
            tokens = torch.where(self.greedy, tokens, torch.argmax(probs.div_(noise), dim=-1))
            del probs, noise
        tokens = torch.where(finite, tokens, 0)
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.int32))
        if self.seen is not None:
            self.seen.scatter_(1, tokens[:, None], True)
        self.step += 1
        columns = [tokens.double()[:, None], finite.double()[:, None]]
        columns.append(ranked(logprobs, tokens, self.logprobs_k) if self.logprobs_k is not None else
                       logprobs.gather(1, tokens[:, None]).double())
        # One copy to the host for everything (token ids are exact in float64).
        host = torch.cat(columns, dim=1).tolist()
        choice = Choice([int(r[0]) for r in host], [r[2] for r in host], [bool(r[1]) for r in host])
        if self.logprobs_k is not None:
            choice.top = [None if k is None else unpack(r[2:], k, token)
                          for r, k, token in zip(host, self.logprobs_asked, choice.tokens)]
        return choice


def ranked(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: the target's log-probability and rank, then the top ``k`` ids and their
    log-probabilities, as float64 columns (rows, 2 + 2k). logprobs: (rows, vocab); targets: (rows,).
    A rank counts the tokens at least as likely (vLLM's)."""
    chosen = logprobs.gather(1, targets[:, None])
    rank = (logprobs >= chosen).sum(dim=-1, keepdim=True)
    values, ids = torch.topk(logprobs, k, dim=-1)
    return torch.cat([chosen.double(), rank.double(), ids.double(), values.double()], dim=1)


def unpack(row: list[float], k: int, target: int) -> list[Ranked]:
    """One row of ``ranked`` as the target then its top ``k`` (at most the row's): (id, logprob, rank)."""
    width = (len(row) - 2) // 2
    ids, values = row[2:2 + width], row[2 + width:]
    return [(target, row[0], int(row[1]))] + [(int(ids[i]), values[i], i + 1) for i in range(k)]


def prompt_ranked(logprobs: torch.Tensor, prompt_ids: list[int], k: int) -> list[list[Ranked] | None]:
    """vLLM's prompt logprobs: None for the first token, then each token's (id, logprob, rank) and
    the top ``k`` alternatives. logprobs: (len(prompt_ids) - 1, vocab), each row predicting the next token."""
    targets = torch.tensor(prompt_ids[1:], device=logprobs.device)
    host = ranked(logprobs, targets, k).tolist() if len(prompt_ids) > 1 else []
    return [None] + [unpack(row, k, token) for token, row in zip(prompt_ids[1:], host)]
