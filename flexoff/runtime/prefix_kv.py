"""The prefixes a GPU batch's rows share: one copy of each one's keys and values, and attention
over them.

The rows of a batch that begin alike form groups (``flexoff.prefixes.batch_groups``), put first
in the batch, group by group. Each group's prefix is one row of a :class:`PrefixKV`, left-padded to
the longest prefix and placed on the tiers like any batch's rows, in the cache's format. The
prefill computes the prefixes as a batch of their own and stores them; after that they take no new
slot. Every attention of the rows is then two: over their own slots as before, and over their
group's prefix, each group's rows' queries folded into its prefix row's (:meth:`Prefixes.fold`), in
place on the GPU, in the prefix's own GPU workspace once ``LOAD_CACHE`` has brought it (the cache
travels), or on the host worker (CPU attention). The two merge exactly by their log-sum-exp
(``models.common.merge_attention``), so a prefix crosses PCIe once per batch and step, not once per
row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..models.common import attention_bias, attention_lse, attention_mask, merge_attention
from .kv import BatchKV
from .packed_prefill import PackedPrefill

Shared = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # finish() -> (output, log-sum-exp), folded


class PrefixKV(BatchKV):
    """The prefixes of one batch's groups, a row each (``slots``: the longest prefix)."""

    def attend_shared(self, layer: int, q: torch.Tensor, mask: torch.Tensor) -> Shared:
        """A decode step's attention of the folded queries ``q`` (prefix rows, heads, queries,
        head_dim) over the prefixes' slots allowed by ``mask`` (prefix rows, 1, 1, slots): the rows'
        own attention paths (``BatchKV``) without a new slot."""
        out = torch.empty_like(q)
        lse = torch.empty((*q.shape[:-1], 1), dtype=torch.float32, device=q.device)
        self._attend_resident(layer, self.slots, q, mask, (out, lse))
        offloaded = self._offloaded()
        if offloaded and self.cpu_attention:
            return self._attend_on_host(layer, self.slots, q, mask, (out, lse), offloaded)
        if offloaded:
            self._attend_workspace(layer, self.slots, q, mask, (out, lse), offloaded)
        return lambda: (out, lse)


class Prefixes:
    """A GPU batch's shared prefixes in flight: each group's rows (the batch's first rows, group by
    group) and prefix, their cache, and at the prefill their inputs, hidden state and context."""

    def __init__(self, spans: list[tuple[int, int, int]], ids: list[list[int]], pad: int, device: torch.device,
                 dtype: torch.dtype, make_prefix):
        """``spans``: each group's rows [start, stop) and prefix length; ``ids``: each group's prefix;
        ``make_prefix(rows, slots)`` -> (its PrefixKV, its activations)."""
        self.spans = spans
        self.length = max(length for _, _, length in spans)
        self.rows = spans[-1][1]  # the rows with a prefix: [0, rows)
        width = self.width = max(stop - start for start, stop, _ in spans)
        padded = [[pad] * (self.length - len(p)) + p for p in ids]
        self.ids = torch.tensor(padded, device=device)
        sizes = [len(p) for p in ids]
        lengths = torch.tensor(sizes, device=device)
        # Prefixes of different lengths (contexts of multiple-choice questions) pack as the rows do.
        self.packed = PackedPrefill.where_it_pays(sizes, self.length, device)
        self.valid = torch.arange(self.length, device=device)[None] >= (self.length - lengths)[:, None]
        self.positions = (torch.cumsum(self.valid.long(), dim=1) - 1).clamp(min=0)
        self.prefill_mask = attention_mask(self.valid, 0, self.length)
        # Every query of a group sees its whole prefix: one bias for every layer and step of the batch,
        # where each attention would convert a boolean mask again.
        self.key_mask = attention_bias(self.valid[:, None, None, :], dtype)
        # Row r of the batch is query row _place[r] of the folded (groups * width) rows.
        place = [g * width + j for g, (start, stop, _) in enumerate(spans) for j in range(stop - start)]
        self._place = torch.tensor(place, device=device)
        self._tiled = place == list(range(len(spans) * width))  # groups alike: folding is a reshape
        self.kv, self.activations = make_prefix(len(spans), self.length)
        self.hidden: torch.Tensor | None = None
        self.context = None

    def fold(self, q: torch.Tensor) -> torch.Tensor:
        """The grouped rows' queries (rows, heads, seq, head_dim) as their prefix rows' (groups,
        heads, width * seq, head_dim), a group's rows side by side (padded with zeros)."""
        _, heads, seq, head_dim = q.shape
        if self._tiled:
            folded = q[:self.rows]
        else:
            folded = q.new_zeros((len(self.spans) * self.width, heads, seq, head_dim))
            folded.index_copy_(0, self._place, q[:self.rows])
        return folded.reshape(len(self.spans), self.width, heads, seq, head_dim).transpose(1, 2).reshape(
            len(self.spans), heads, self.width * seq, head_dim)

    def unfold(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`fold` for an output or log-sum-exp: (rows, heads, seq, last)."""
        groups, heads, length, last = x.shape
        rows = x.view(groups, heads, self.width, length // self.width, last).transpose(1, 2)
        rows = rows.reshape(groups * self.width, heads, length // self.width, last)
        return rows if self._tiled else rows.index_select(0, self._place)

    def merged(self, own, shared):
        """Attention of the rows over their own tokens (``own``, giving its log-sum-exp) and over
        their group's prefix (``shared(folded q)``, which starts it and returns its finish)."""
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            finish = shared(self.fold(q))
            return self.merge(*own(q, k, v), finish)

        return attend

    def merge(self, out: torch.Tensor, lse: torch.Tensor, finish: Shared) -> torch.Tensor:
        shared_out, shared_lse = finish()
        merge_attention(out[:self.rows], lse[:self.rows], self.unfold(shared_out), self.unfold(shared_lse))
        return out

    def attend_fresh(self, k: torch.Tensor, v: torch.Tensor):
        """At the prefill: folded queries over the prefixes' fresh keys and values."""
        def shared(q: torch.Tensor) -> Shared:
            result = attention_lse(q, k, v, self.key_mask)
            return lambda: result

        return shared
