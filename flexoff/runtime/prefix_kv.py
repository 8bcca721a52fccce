"""The one copy of a GPU batch's shared prefix: its keys and values, and attention over them.

A prefix is one row of cache on the tier a single row of the policy's cache goes to, in the cache's
format. Its prefill stores it like any batch's (it is a :class:`~.kv.BatchKV` of one row); after
that it takes no new slot. Each decode step every row of the batch attends over it in one call,
its queries folded into one row's, wherever the batch's own rows attend: in place on the GPU,
in the prefix's own GPU workspace once ``LOAD_CACHE`` has brought it (the cache travels), or on the
host worker (CPU attention). The caller merges the result with the rows' own attention by
log-sum-exp (``models.common.merge_attention``), so the prefix crosses PCIe once per batch and
step, not once per row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..models.common import attention_lse, fold_rows, unfold_rows
from .kv import BatchKV
from .kv_storage import SLOT_MAJOR
from .tiers import read_pinned

Shared = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # finish() -> (output, log-sum-exp) per row


class PrefixKV(BatchKV):
    """One row of cache holding a prefix the batch's rows share (``slots``: its length)."""

    def attend_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The prefix's own prefill attention (causal), its keys and values stored to its tiers
        like any batch's."""
        mask = torch.ones((1, 1, self.slots, self.slots), dtype=torch.bool, device=q.device).tril_()
        return self._attend(layer, 0, mask, q, k, v)

    @staticmethod
    def attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Shared:
        """At the prefill, the rows' queries ``q`` over the prefix's fresh keys and values
        (1, kv_heads, prefix, head_dim): finish() -> (output, log-sum-exp) in q's rows."""
        shared = attention_lse(fold_rows(q), k, v)
        return lambda: tuple(unfold_rows(x, q.shape[0]) for x in shared)

    def attend_shared(self, layer: int, q: torch.Tensor) -> Shared:
        """A decode step's attention of every row's queries ``q`` (rows, heads, 1, head_dim) over
        the prefix; returns finish() -> (output, log-sum-exp) in q's rows."""
        rows, folded = q.shape[0], fold_rows(q)
        group, end = self.groups[0], self.slots
        if group.tier == "gpu":
            keys, values = (group.read(buffer, end, out=space)
                            for buffer, space in zip(group.pair(layer), self._dequantized()))
            shared = attention_lse(folded, keys, values)
        elif not self.cpu_attention:
            shared = self._attend_travelled(layer, folded)
        else:
            return self._attend_on_host(layer, folded, rows)
        return lambda: tuple(unfold_rows(x, rows) for x in shared)

    def _attend_travelled(self, layer: int, folded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over the copy ``prefetch`` loaded into the prefix's workspace."""
        index, ready, from_disk = self._state[layer].take_load()
        self.streams.wait(self.streams.compute, ready)
        if from_disk is not None:
            self.streams.wait(self.streams.compute, from_disk.result())
        loaded = self._workspace_rows(index, self.groups[0], 0)
        keys, values = (SLOT_MAJOR.read(self.fmt, buffer, self.slots, out=space)
                        for buffer, space in zip(loaded, self._dequantized()))
        shared = attention_lse(folded, keys, values)
        self.workspace.free_events[index] = self.streams.record(self.streams.compute)
        return shared

    def _attend_on_host(self, layer: int, folded: torch.Tensor, rows: int) -> Shared:
        """CPU attention over the prefix on the host worker (disk rows read in first); the output
        and log-sum-exp land in pinned buffers of the batch's, which the next job waits to reuse
        as ``attend_later``'s do."""
        group, end = self.groups[0], self.slots
        shape = folded.shape
        if self._landing is None or self._landing[0].shape != shape:
            self._landing = (self.host.empty(shape, folded.dtype), self.host.empty((*shape[:-1], 1), torch.float32))
        landing, landing_lse = self._landing

        def attend() -> None:
            queries = folded.to("cpu", self.dtype)
            group.load(layer, end)
            keys, values = (group.read(buffer, end) for buffer in group.pair(layer))
            out, lse = attention_lse(queries, keys, values)
            landing.copy_(out)
            landing_lse.copy_(lse)

        job = self.worker.submit(attend, self.streams.record(self.streams.compute))

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            job.result()
            out = torch.empty(shape, dtype=folded.dtype, device=folded.device)
            lse = torch.empty((*shape[:-1], 1), dtype=torch.float32, device=folded.device)
            read_pinned(out, landing)
            read_pinned(lse, landing_lse)
            return unfold_rows(out, rows), unfold_rows(lse, rows)

        return finish
