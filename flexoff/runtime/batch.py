"""Sequences in flight and the GPU batches that carry them through the stages."""

from __future__ import annotations

from collections import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch

from ..models import ModelConfig, architecture
from ..models.common import attention_bias, attention_mask
from ..prefixes import batch_groups
from .activations import BatchActivations
from .decode_graphs import DecodeGraphs
from .kv import BatchKV
from .packed_prefill import PackedPrefill
from .prefix_kv import Prefixes
from .sampler import Ranked
from .sampling import SamplingParams
from .weight_store import StageWeights


@dataclass
class Sequence:
    """One prompt in flight: its inputs, what it has produced, and why it stopped."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # its sampling generator's (unused when greedy)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # With params.logprobs: per generated token, the token then its top alternatives.
    top_logprobs: list[list[Ranked]] = field(default_factory=list)
    # With params.prompt_logprobs: per prompt token (None for the first), the same.
    prompt_logprobs: list[list[Ranked] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why it failed (finish_reason "error"); its tokens are then dropped
    keep: int = 1  # how many of the prompt's last positions the head reads (a score's continuation and one)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # What a sequence produced, as plain data: sent from the device that sampled it to the one
    # that reports it (a pipeline's last device to its first, a replica to the others).
    OUTCOME = ("token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "finish_reason", "stop_reason", "error")

    def outcome(self) -> tuple:
        return tuple(getattr(self, name) for name in self.OUTCOME)

    def take_outcome(self, outcome: tuple) -> None:
        for name, value in zip(self.OUTCOME, outcome, strict=True):
            setattr(self, name, value)

    @property
    def head_reads(self) -> int:
        """The prompt's last positions whose hidden states the head reads: all of them for prompt
        log-probabilities."""
        return len(self.prompt_ids) if self.params.prompt_logprobs is not None else self.keep

    def fail(self, error: str) -> None:
        self.finish_reason, self.error = "error", error
        self.token_ids.clear()
        self.logprobs.clear()
        self.top_logprobs.clear()


def arrange(seqs: list[Sequence]) -> tuple[list[Sequence], list[tuple[int, int, int]]]:
    """A GPU batch's rows in the order it runs them, and the groups that share a prefix
    (``flexoff.prefixes.batch_groups``): each group's rows [start, stop) and prefix length, the
    groups first."""
    groups = batch_groups([s.prompt_ids for s in seqs], [s.head_reads for s in seqs])
    order, spans = [], []
    for rows, length in groups:
        spans.append((len(order), len(order) + len(rows), length))
        order += sorted(rows)
    grouped = set(order)
    order += [r for r in range(len(seqs)) if r not in grouped]
    return [seqs[r] for r in order], spans


def span_lengths(rows: int, spans) -> list[int]:
    """Each of a batch's ``rows`` rows' shared prefix length, from ``arrange``'s spans (0 past them)."""
    lengths = [0] * rows
    for start, stop, length in spans:
        lengths[start:stop] = [length] * (stop - start)
    return lengths


class GpuBatch:
    """One GPU batch of a block: left-padded inputs, its cache and activations, and the state of the
    token in flight.

    The cache has a slot per prompt position (padding included) and per generated token. Where
    groups of rows share a prefix (``spans``, from ``arrange``), each is held once (``Prefixes``) and
    the rows' cache, inputs and ``prompt_len`` cover the rest of each prompt. The block schedule
    says which of these methods run, and when.
    """

    def __init__(self, cfg: ModelConfig, seqs: list[Sequence], device: torch.device, dtype: torch.dtype,
                 extra_slots: int, make_kv, make_activations, spans=(), make_prefix=None):
        self.cfg = cfg
        self.arch = architecture(cfg)
        self.seqs = seqs
        self.device = device
        self.dtype = dtype
        pad = self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.prefix: Prefixes | None = None
        if spans:
            self.prefix = Prefixes(list(spans), [seqs[start].prompt_ids[:length] for start, _, length in spans],
                                   pad, device, dtype, make_prefix)
        prefix_lengths = span_lengths(len(seqs), spans)
        own = [s.prompt_ids[n:] for s, n in zip(seqs, prefix_lengths)]
        self.prompt_len = max(len(ids) for ids in own)
        self.slots = self.prompt_len + extra_slots
        rows = [[pad] * (self.prompt_len - len(ids)) + ids for ids in own]
        self.prompt_ids = torch.tensor(rows, device=device)  # (batch, prompt_len)
        self.lengths = torch.tensor([len(s.prompt_ids) for s in seqs], device=device)
        self._prefix_lengths = torch.tensor(prefix_lengths, device=device)
        own_lengths = self.lengths - self._prefix_lengths
        # Rows with one prompt (a prompt's n samples) share its prefill: the prefill computes each
        # distinct prompt once, from its first row, and every row's cache is filled from its prompt's.
        place: dict[tuple[int, ...], int] = {}  # each distinct prompt -> its row in the prefill
        firsts: list[int] = []  # the first row of each distinct prompt
        source: list[int] = []  # row -> its prompt's row in the prefill
        for row, ids in enumerate(own):
            key = tuple(ids)
            if key not in place:
                place[key] = len(firsts)
                firsts.append(row)
            source.append(place[key])
        self.prefill_rows = len(firsts)
        # Tokens the prefill computes, and those it computed once for all rows.
        self.prefill_tokens = sum(length for _, _, length in spans) + sum(len(own[row]) for row in firsts)
        self.shared_tokens = sum((stop - start - 1) * length for start, stop, length in spans)
        shared = len(firsts) < len(seqs) and not spans
        self._source = source if shared else None
        self._expand = torch.tensor(source, device=device) if shared else None
        self._firsts = torch.tensor(firsts, device=device) if shared else None
        # The prefill's matmuls run over its real positions alone where its rows pad enough.
        fill_lengths = [len(own[row]) for row in (firsts if shared else range(len(seqs)))]
        self._packed = PackedPrefill.where_it_pays(fill_lengths, self.prompt_len, device)
        slot = torch.arange(self.slots, device=device)
        # (batch, slots): False on left padding; every generated slot is real.
        self.valid = slot[None, :] >= (self.prompt_len - own_lengths)[:, None]
        self.kv: BatchKV = make_kv(len(seqs), self.slots, self.prefix is not None)
        self.activations: BatchActivations = make_activations(len(seqs), self.prompt_len)
        self._active = True
        # The token in flight (set by begin_token): its inputs, first cache slot, mask and the
        # architecture's per-step context; the hidden state between stages.
        self.input_ids: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.start = 0
        self.mask: torch.Tensor | None = None
        self.context = None
        self.hidden: torch.Tensor | None = None
        self._finish: Callable[[], torch.Tensor] | None = None  # the rest of a layer whose attention runs on the host

    @property
    def active(self) -> bool:
        """Whether the batch still runs: the one record of it, which the schedule reads through
        ``Running`` and the interpreter clears (``retire``)."""
        return self._active

    def retire(self) -> None:
        """The batch takes no further step of the block's schedule."""
        self._active = False

    def slot_start(self, token: int) -> int:
        """First cache slot written at ``token`` (0 is the prefill)."""
        return 0 if token == 0 else self.prompt_len + token - 1

    def begin_token(self, token: int) -> None:
        """Set the token's input ids, positions, slot range and attention mask."""
        valid = self.valid
        if token == 0:
            if self._firsts is not None:
                valid = valid[self._firsts]
            self.input_ids = self.prompt_ids if self._firsts is None else self.prompt_ids[self._firsts]
            self.positions = (torch.cumsum(valid[:, :self.prompt_len].long(), dim=1) - 1).clamp(min=0)
            if self.prefix is not None:
                self.positions += self._prefix_lengths[:, None]
                self.prefix.context = self._prefill_context(self.prefix.packed, self.prefix.positions)
            self.context = self._prefill_context(self._packed, self.positions)
        else:
            if self.prefix is not None:
                self.prefix.hidden = None  # the prefix is cached; its last layer's output is not read
            # A failed sequence has no tokens; its row, isolated from the others, is fed padding.
            last = [s.token_ids[-1] if s.token_ids else self.pad for s in self.seqs]
            self.input_ids = torch.tensor(last, device=self.device)[:, None]
            self.positions = (self.lengths + token - 1)[:, None]
        self.start = self.slot_start(token)
        self.mask = attention_mask(valid, self.start, self.input_ids.shape[1])
        if token > 0:
            # One bias for all of a decode step's layers, where each call converting the mask was
            # host time; the prefill keeps the boolean mask, half the memory of a bias over its keys.
            self.mask = attention_bias(self.mask, self.dtype)
            self.context = self.arch.step_context(self.cfg, self.positions, self.dtype)

    def _prefill_context(self, packed: PackedPrefill | None, positions: torch.Tensor):
        """The prefill's step context, of the positions its layers see: the packed ones where they
        run packed."""
        return self.arch.step_context(self.cfg, positions if packed is None else packed.pack(positions), self.dtype)

    def prefill_row(self, row: int) -> int:
        """The row of the prefill's hidden state that holds ``row``'s prompt."""
        return row if self._source is None else self._source[row]

    def row_hidden(self, positions: slice) -> torch.Tensor:
        """The hidden state at ``positions``, one row per sequence (after a shared prefill too)."""
        hidden = self.hidden[:, positions]
        return hidden if self.start > 0 or self._expand is None else hidden.index_select(0, self._expand)

    def embed(self, weights: dict) -> None:
        self.hidden = self.arch.embed(self.cfg, weights, self.input_ids, self.positions)
        prefix = self.prefix
        if prefix is not None and self.start == 0:
            prefix.hidden = self.arch.embed(self.cfg, weights, prefix.ids, prefix.positions)

    def layer(self, layer: int, weights: StageWeights, graphs: DecodeGraphs | None = None) -> None:
        """Decoder layer ``layer``, attention included (on the GPU, or waited for); a sparse layer's
        experts load into ``weights`` once routed, where they load route first. A shared prefix's
        rows run first at the prefill; the rows then attend over it and over their own tokens. At
        decode, ``graphs`` (if any) runs the layer's halves around attention."""
        attend = self.kv.attender(layer, self.start, self.mask, self._expand if self.start == 0 else None)
        prefix = self.prefix
        if prefix is not None:
            attend = self._prefill_prefix(layer, weights, attend) if self.start == 0 else \
                prefix.merged(attend, partial(prefix.kv.attend_shared, layer, mask=prefix.key_mask))
        if self.start == 0:
            self.hidden = self._prefill_layer(self, self._packed, weights, attend)
        elif graphs is not None:
            self.hidden = graphs.layer(self.arch, self.cfg, weights, self.hidden, self.context, attend)
        else:
            self.hidden = self.arch.layer(self.cfg, weights, self.hidden, self.context, attend, weights)

    def _prefill_layer(self, owner, packed: PackedPrefill | None, weights: StageWeights, attend) -> torch.Tensor:
        """A prefill layer of ``owner``'s hidden state and context (the batch's rows, or its
        prefixes'), packed where its rows pad enough."""
        if packed is not None:
            return packed.layer(self.arch, self.cfg, weights, owner, attend)
        return self.arch.layer(self.cfg, weights, owner.hidden, owner.context, attend, weights)

    def _prefill_prefix(self, layer: int, weights: StageWeights, own):
        """Run the prefix's layer once; returns the rows' attention, merged with the prefix's."""
        prefix, kept = self.prefix, []

        def attend_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kept.append((k, v))
            return prefix.kv.attender(layer, 0, prefix.prefill_mask)(q, k, v)

        prefix.hidden = self._prefill_layer(prefix, prefix.packed, weights, attend_prefix)
        (k_prefix, v_prefix), = kept
        return prefix.merged(own, prefix.attend_fresh(k_prefix, v_prefix))

    def start_attention(self, layer: int, weights: StageWeights) -> None:
        """Decoder layer ``layer`` up to attention, which the host worker runs meanwhile; the rest
        is left to ``finish_attention``."""
        hidden, self.hidden = self.hidden, None
        arch, cfg = self.arch, self.cfg
        q, k, v = arch.attention_inputs(cfg, weights, hidden, self.context)
        if self.prefix is None:
            attended = self.kv.attend_later(layer, self.start, self.mask, q, k, v)
        else:
            prefix = self.prefix
            shared = prefix.kv.attend_shared(layer, prefix.fold(q), prefix.key_mask)
            own = self.kv.attend_later(layer, self.start, self.mask, q, k, v)

            def attended() -> torch.Tensor:
                return prefix.merge(*own(), shared)
        # Closed over locals, not self: the batch holding its own closure would be a cycle.
        self._finish = lambda: arch.after_attention(cfg, weights, hidden, attended(), weights)

    def finish_attention(self) -> None:
        """Wait for the layer's attention, then enqueue the rest of it."""
        finish, self._finish = self._finish, None
        self.hidden = finish()

    def store_activation(self) -> None:
        """Send the hidden state (and at the prefill, a shared prefix's) to its tiers."""
        self.activations.put(self.hidden)
        self.hidden = None
        if self.prefix is not None and self.prefix.hidden is not None:
            self.prefix.activations.put(self.prefix.hidden)
            self.prefix.hidden = None

    def load_activation(self) -> None:
        """Bring the hidden state back to the compute device."""
        self.hidden = self.activations.get()
        if self.prefix is not None and self.start == 0:
            self.prefix.hidden = self.prefix.activations.get()

    def prefetch(self, layer: int, token: int) -> None:
        """LOAD_CACHE of ``layer`` for ``token``: the rows' cache, and a shared prefix's."""
        start = self.slot_start(token)
        self.kv.prefetch(layer, start)
        if self.prefix is not None and start:
            self.prefix.kv.prefetch(layer, self.prefix.length)

    def read_ahead(self, layer: int, token: int) -> None:
        """READ_CACHE of ``layer`` for ``token``: disk rows read ahead, a shared prefix's too."""
        start = self.slot_start(token)
        self.kv.read_ahead(layer, start)
        if self.prefix is not None and start:
            self.prefix.kv.read_ahead(layer, self.prefix.length)


class Running(abc.Sequence[bool]):
    """Which of a block's GPU batches still run, as the schedule reads it between steps
    (``block_schedule``'s ``active``): a view of each batch's own ``active``, so that the schedule,
    the interpreter and the batch read one record."""

    __slots__ = ("_batches",)

    def __init__(self, batches: list[GpuBatch]):
        self._batches = batches

    def __getitem__(self, k: int) -> bool:
        return self._batches[k].active

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[bool]:
        return (batch.active for batch in self._batches)
