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
    """

    def __init__(self, seqs: SequenceOf, eos_ids: SequenceOf[int], vocab_size: int, device: torch.device):
        params = [s.params for s in seqs]
        self.rows, self.vocab, self.device = len(params), vocab_size, device
        self.step = 0
        self.logprobs_asked = [p.logprobs for p in params]
        self.logprobs_k = max((k for k in self.logprobs_asked if k is not None), default=None)

        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)[:, None]

        def mask(ids_per_row):  # (rows, vocab): True at each row's ids
            out = torch.zeros(self.rows, vocab_size, dtype=torch.bool, device=device)
            for row, ids in enumerate(ids_per_row):
                ids = [i for i in ids if i < vocab_size]
                if ids:
                    out[row, torch.tensor(ids, device=device)] = True
            return out

        self.greedy = column([p.greedy for p in params], torch.bool)[:, 0]
        self.all_greedy = all(p.greedy for p in params)
        self.temperature = column([1.0 if p.greedy else p.temperature for p in params])
        self.min_p = column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None
        # top_k 0 keeps every token, as the vocabulary's size (or more) does.
        self.top_k_keep = (column([min(p.top_k or vocab_size, vocab_size) for p in params], torch.long)
                           if any(0 < p.top_k < vocab_size for p in params) else None)
        self.top_p = column([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None
        self.generators = [None if p.greedy else torch.Generator(device).manual_seed(s.seed)
                           for p, s in zip(params, seqs)]
        # min_tokens: each row's stop ids (EOS unless ignored, and its stop token ids), masked while
        # it has produced fewer than min_tokens.
        self.min_tokens = None
        if any(p.min_tokens for p in params):
            self.min_tokens = column([p.min_tokens for p in params], torch.long)
            self.stop_ids = mask([(() if p.ignore_eos else tuple(eos_ids)) + p.stop_token_ids for p in params])
        self.repetition = column([p.repetition_penalty for p in params]) \
            if any(p.repetition_penalty != 1 for p in params) else None
        self.frequency = column([p.frequency_penalty for p in params]) \
            if any(p.frequency_penalty for p in params) else None
        self.presence = column([p.presence_penalty for p in params]) \
            if any(p.presence_penalty for p in params) else None
        # Output token counts per row (rows, vocab), and the prompt's tokens for the repetition penalty.
        penalised = any(x is not None for x in (self.repetition, self.frequency, self.presence))
        self.counts = torch.zeros(self.rows, vocab_size, dtype=torch.int32, device=device) if penalised else None
        self.in_prompt = mask([s.prompt_ids for s in seqs]) if self.repetition is not None else None

    def __len__(self) -> int:
        return self.rows

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits greedy rows take the argmax of: stop tokens masked under min_tokens, then the
        penalties, as vLLM's formulas. logits: (rows, vocab) fp32."""
        if self.min_tokens is not None:
            logits = logits.masked_fill(self.stop_ids & (self.step < self.min_tokens), -torch.inf)
        if self.counts is None:
            return logits
        generated = self.counts > 0
        if self.repetition is not None:
            penalty = torch.where(self.in_prompt | generated, self.repetition, 1.0)
            logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        if self.frequency is not None:
            logits = logits - self.frequency * self.counts
        if self.presence is not None:
            logits = logits - self.presence * generated
        return logits

    def warped(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampled rows' logits after temperature, min-p, top-k and top-p (dropped tokens at -inf)."""
        logits = logits / self.temperature
        if self.min_p is not None:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < self.min_p * probs.amax(dim=-1, keepdim=True), -torch.inf)
        if self.top_k_keep is None and self.top_p is None:
            return logits
        values, order = torch.sort(logits, dim=-1, descending=True)
        if self.top_k_keep is not None:
            kth = values.gather(1, self.top_k_keep - 1)
            values = values.masked_fill(values < kth, -torch.inf)  # ties with the k-th token stay
        if self.top_p is not None:
            probs = torch.softmax(values, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            values = values.masked_fill(torch.cumsum(probs, dim=-1) - probs >= self.top_p, -torch.inf)
        return torch.empty_like(logits).scatter_(1, order, values)

    def choose(self, logits: torch.Tensor, live: SequenceOf[bool]) -> Choice:
        """The next token of each row; ``live`` says which rows still generate (the others draw no
        noise, so that a row's draws are its own). logits: (rows, vocab)."""
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        # Any NaN or +inf in a row makes its normaliser, so its largest logprob, non-finite.
        finite = torch.isfinite(logprobs.amax(dim=-1))
        adjusted = self.adjusted(logits)
        tokens = torch.argmax(adjusted, dim=-1)
        if not self.all_greedy:
            probs = torch.softmax(self.warped(adjusted), dim=-1)
            noise = torch.ones_like(probs)
            for row, generator in enumerate(self.generators):
                if generator is not None and live[row]:
                    noise[row].exponential_(generator=generator)
            tokens = torch.where(self.greedy, tokens, torch.argmax(probs / noise, dim=-1))
        tokens = torch.where(finite, tokens, 0)
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=torch.int32))
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
