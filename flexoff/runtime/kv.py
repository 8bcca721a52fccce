"""The KV cache of one GPU batch, split by rows (sequences) across gpu, cpu and disk.

Caches that travel are stored slot-major, a CPU cache that CPU attention reads in place row-major
(see :mod:`.kv_storage` for why). With ``policy.compress_cache`` every tier stores keys and values
quantized group-wise along head_dim: new slots are quantized as they are stored, and the bytes
that move between tiers are the compressed ones.

Rows on the GPU attend in place (a compressed cache is first decompressed into a GPU workspace).
Rows elsewhere either travel to a GPU workspace each decode step, or, with CPU attention, stay
put: only the queries and outputs cross PCIe, and attention runs on the CPU in the cache's dtype,
a few sequences at a time, decompressing only those sequences. The prefill attends on the fresh
keys and values; the cache only keeps them.

New slots of a travelling CPU cache (slot-major, so a slot is one contiguous run) are stored by
asynchronous copies on the store stream, enqueued by the main thread; the load of that layer's
cache for the next token waits for them on the GPU, so no thread waits. Other host work (writing
new slots into a row-major CPU cache or to disk, CPU attention) runs on the engine's one
:class:`~.tiers.HostWorker` thread, and disk rows' reads on its reader threads, so the main thread
never waits for a device-to-host copy or a file and keeps enqueuing GPU work. The worker runs jobs in order, which
orders every write to a layer's host cache before the next read of it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

import torch

from ..layout import CPU_ATTENTION_ROWS, split_rows
from ..models import ModelConfig
from ..models.common import attention, attention_lse
from .kv_groups import DiskRows, KVWorkspace, RowsHome, TierRows, copy_async, own_rows, tier_rows
from .kv_state import LayerKV, Load
from .kv_storage import SLOT_MAJOR, kv_format
from ..policy import TIERS, Policy
from .tiers import DiskTier, HostMemory, HostWorker, StoreQueue, Streams, read_pinned


def attend_rows(out: torch.Tensor, lse: torch.Tensor | None, rows: slice, q: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, mask: torch.Tensor) -> None:
    """Attention of ``rows`` into ``out`` and, where a shared prefix's attention is merged in
    afterwards, their log-sum-exp into ``lse``."""
    if lse is None:
        out[rows] = attention(q, keys, values, mask)
    else:
        out[rows], lse[rows] = attention_lse(q, keys, values, mask)


def cpu_attention(q: torch.Tensor, read_keys, read_values, mask: torch.Tensor,
                  out: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Attention on host tensors, chunked over sequences so no copy of the whole cache is made.

    ``read_keys(rows)`` gives those rows' keys (rows, kv_heads, keys, head_dim): a view of a
    plain cache, or the rows of a compressed one decompressed for this call. The output goes to
    ``out`` (q's shape) when given, the log-sum-exp to ``lse`` when given.
    """
    out = torch.empty_like(q) if out is None else out
    for start in range(0, q.shape[0], CPU_ATTENTION_ROWS):
        rows = slice(start, min(start + CPU_ATTENTION_ROWS, q.shape[0]))
        attend_rows(out, lse, rows, q[rows], read_keys(rows), read_values(rows), mask[rows])
    return out


def lse_like(q: torch.Tensor, merges: bool) -> torch.Tensor | None:
    """Where a batch's attention is merged with its shared prefix's: room for each query's log-sum-exp."""
    return torch.empty((*q.shape[:-1], 1), dtype=torch.float32, device=q.device) if merges else None


@dataclass(frozen=True)
class BlockKV:
    """What the caches of one block's GPU batches share: the model, policy and device, the streams,
    the block's host memory and offload tier, the host worker, the GPU workspace and the stores in
    flight on the store stream."""

    cfg: ModelConfig
    policy: Policy
    device: torch.device
    dtype: torch.dtype
    streams: Streams
    host: HostMemory
    disk: DiskTier | None
    worker: HostWorker
    workspace: KVWorkspace | None
    stores: StoreQueue = field(default_factory=StoreQueue)
    layers: tuple[int, ...] | None = None  # the decoder layers whose caches are held here (None: all)


class BatchKV:
    """The cache of one GPU batch; ``attend`` is what a layer calls to store and attend.

    Its host work runs on the block's worker thread; the state read there (a layer's storage, the
    output landing buffer) is handed over by the jobs themselves, and the main thread waits for a
    job before it touches what that job writes. Each layer's state between its steps (a read made
    ahead, a load, the last writes to its host rows) is a :class:`~.kv_state.LayerKV`, the main
    thread's alone.
    """

    def __init__(self, block: BlockKV, rows: int, slots: int, name: str, merges: bool = False, keeps: bool = True):
        """``keeps`` False: a block that never reads its cache again (``layout.keeps_cache``) holds
        none; its prefill attends on the fresh keys and values alone."""
        policy = block.policy
        self.cfg = block.cfg
        self.cpu_attention = policy.cpu_attention
        self.streams = block.streams
        self.worker = block.worker
        self.host = block.host
        self.device = block.device
        self.dtype = block.dtype
        self.workspace = block.workspace
        self.stores = block.stores
        self.fmt = kv_format(policy.compress_cache, block.dtype)
        self.slots = slots
        # Whether attention also gives its log-sum-exp, to be merged with a shared prefix's.
        self.merges = merges
        layers = range(block.cfg.num_layers) if block.layers is None else block.layers
        home = RowsHome(block.cfg, layers, slots, self.fmt, block.device, block.host, block.disk)
        self.groups = [tier_rows(p, home, policy.cpu_attention, f"{name}.{p.tier}")
                       for p in split_rows(rows, policy.cache)] if keeps else []
        self._disk: DiskRows | None = next((g for g in self.groups if isinstance(g, DiskRows)), None)
        self._state = {j: LayerKV(j) for j in layers}
        # CPU attention's output, (offloaded rows, heads, 1, head_dim), pinned: written by the
        # worker's job, read by the main thread once it has waited for that job.
        self._landing: tuple[torch.Tensor, torch.Tensor | None] | None = None  # and the log-sum-exp's

    @property
    def decodes_on_host(self) -> bool:
        """Whether decode attention runs on the host worker (CPU attention, with rows off the GPU)."""
        return self.cpu_attention and bool(self._offloaded())

    @property
    def travels(self) -> bool:
        """Whether off-GPU rows are loaded to the GPU workspace for each decode layer."""
        return not self.cpu_attention and bool(self._offloaded())

    @property
    def reads_ahead(self) -> bool:
        """Whether a travelling cache has disk rows, read a layer ahead of their load (READ_CACHE)."""
        return self.travels and self._disk is not None

    def _offloaded(self) -> list[TierRows]:
        return [g for g in self.groups if g.tier != "gpu"]

    def _on_worker(self, group: TierRows) -> bool:
        # Disk rows are always the worker's (their file writes and reads would stall the main
        # thread, and a write from the GPU would synchronise with it), and so is their staging
        # pair, shared by all layers: the worker's jobs run in order, so it is never used twice at
        # once. Slot-major CPU rows are written by copies on the store stream.
        if group.tier == "cpu":
            return group.layout is not SLOT_MAJOR
        return group.tier == "disk"

    def _on_store_stream(self, group: TierRows) -> bool:
        return group.tier == "cpu" and group.layout is SLOT_MAJOR and self.streams.store is not None

    def _store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, groups: list[TierRows]) -> None:
        """Store new keys and values (batch, kv_heads, seq, head_dim) at slots [start, start + seq)
        of ``groups``; host rows' share is written by the store stream or the worker, after this
        point of the compute stream (k and v stay referenced until they are copied)."""
        later = [group for group in groups if self._on_worker(group)]
        streamed = [group for group in groups if self._on_store_stream(group)]
        for group in groups:
            if group not in later and group not in streamed:
                group.put(layer, start, k[group.rows], v[group.rows])
        if streamed:
            self._store_on_stream(layer, start, k, v, streamed)
        if later:
            rows = [(group, own_rows(k, group), own_rows(v, group)) for group in later]

            def write() -> None:
                for group, keys, values in rows:
                    group.put(layer, start, keys, values, self.worker.copy_to_host)

            self._state[layer].wrote(self.worker.submit(write, self.streams.record(self.streams.compute)))

    def _store_on_stream(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor,
                         groups: list[TierRows]) -> None:
        """Store slot-major CPU rows by asynchronous copies (encoded on the GPU first) on the store
        stream, after this point of the compute stream. Their inputs are kept alive for the store
        stream; the next load of the layer waits for the copies (``prefetch``)."""
        streams = self.streams
        rows = [(group, own_rows(k, group), own_rows(v, group)) for group in groups]
        streams.wait(streams.store, streams.record(streams.compute))
        held = 0
        with streams.on(streams.store):
            for group, keys, values in rows:
                for x in (keys, values):
                    x.record_stream(streams.store)
                    held += x.numel() * x.element_size()
                group.put(layer, start, keys, values, copy_async)
        stored = streams.record(streams.store)
        self._state[layer].streamed(stored)
        self.stores.add(stored, held)

    def _dequantized(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.workspace.dequantized if self.workspace is not None else (None, None)

    def prefetch(self, layer: int, start: int) -> None:
        """LOAD_CACHE, before a decode step: bring off-GPU rows' first ``start`` slots to the GPU
        workspace.

        CPU rows are copied now, on the cache stream. Disk rows are read and copied by the worker's
        reader thread (the read made ahead by ``read_ahead``, or one made now), so that neither the
        main thread nor the worker's writes wait for the file. CPU attention reads disk rows in just
        before it runs instead.
        """
        groups = self._offloaded()
        if not groups or start == 0 or self.cpu_attention:
            return
        state = self._state[layer]
        ahead = state.take_read()
        index = self.workspace.take()
        self.streams.wait(self.streams.cache, state.take_stored())  # CPU rows' last slot
        first = groups[0].rows.start
        self._copy_in([g for g in groups if g.tier != "disk"], layer, start, index, first)
        ready = self.streams.record(self.streams.cache)
        disk, from_disk = self._disk, None
        if disk is not None:
            read = self._disk_read(disk, state, start, ahead)
            from_disk = self.worker.after(read, partial(self._copy_staged, [disk], layer, start, index, first))
            disk.copied_out[layer % 2] = from_disk
        state.loaded(Load(index, ready, from_disk))

    def read_ahead(self, layer: int, start: int) -> None:
        """READ_CACHE, while the layer before loads: read disk rows' first ``start`` slots of
        ``layer`` into its staging pair, so that the drive's latency passes behind that layer."""
        if self._disk is None or start == 0 or self.cpu_attention:
            return
        state = self._state[layer]
        state.read_ahead(start, self._disk_read(self._disk, state, start, None))

    def _disk_read(self, disk: DiskRows, state: LayerKV, start: int, ahead: tuple[int, Future] | None) -> Future:
        """Disk rows' read of a layer's first ``start`` slots into its staging pair: the one made
        ahead (``ahead``), or one made now, once the layer's last write and the last copy out of
        the pair are done."""
        if ahead is not None:
            made_for, read = ahead
            if made_for == start:
                return read
            read.result()  # made for a step that did not run (its batch had finished): let it land
        layer = state.layer
        return self.worker.read(partial(self._fill_staging, disk, layer, start, state.take_written(),
                                        disk.copied_out[layer % 2]))

    @staticmethod
    def _fill_staging(disk: DiskRows, layer: int, start: int, written: Future | None, user: Future | None) -> None:
        """A reader's job: once the worker has written this layer's last slot (``written``) and the
        last copy out of its staging pair (``user``'s) has finished, refill the pair from the files."""
        if written is not None:
            written.result()
        copied = user.result() if user is not None else None
        if copied is not None:
            copied.synchronize()
        disk.load(layer, start)

    def _copy_staged(self, groups: list[TierRows], layer: int, start: int, index: int, first: int):
        """Once the read has landed (on its reader thread, or here if it already had): copy the
        staging pairs into the workspace; returns the copies' event."""
        self._copy_in(groups, layer, start, index, first)
        return self.streams.record(self.streams.cache)

    def _copy_in(self, groups: list[TierRows], layer: int, start: int, index: int, first: int) -> None:
        """Copy the groups' first ``start`` slots into workspace set ``index`` on the cache stream
        (disk rows from their staging pair, which a reader has filled)."""
        with self.streams.on(self.streams.cache):
            for group in groups:
                for target, source in zip(self._workspace_rows(index, group, first), group.pair(layer)):
                    target.narrow(0, 0, start).copy_(source.narrow(0, 0, start), non_blocking=True)

    def _workspace_rows(self, index: int, group: TierRows, first: int) -> tuple:
        return self.workspace.rows(index, group.rows.start - first, group.rows.stop - group.rows.start)

    def attender(self, layer: int, start: int, mask: torch.Tensor, expand: torch.Tensor | None = None):
        """What a layer calls to store its new keys and values and attend. ``expand`` (prefill only):
        the prefill computed each distinct prompt once; row r's cache comes from its row expand[r]."""
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            return self._attend(layer, start, mask, q, k, v, expand)

        return attend

    def _attend(self, layer, start, mask, q, k, v, expand=None):
        """The output, or with ``merges`` (output, log-sum-exp)."""
        if start == 0:
            # Prefill: attend on the fresh keys, then send them to their tiers.
            out = attention_lse(q, k, v, mask) if self.merges else attention(q, k, v, mask)
            if self.groups:
                if expand is not None:
                    k, v = k.index_select(0, expand), v.index_select(0, expand)
                self._store(layer, 0, k, v, self.groups)
            return out
        if self.attends_on_cpu(start):
            return self.attend_later(layer, start, mask, q, k, v)()
        out, lse = self._attend_on_gpu(layer, start, mask, q, k, v)
        offloaded = self._offloaded()
        if offloaded:  # loaded by the schedule's LOAD_CACHE
            self._attend_loaded(layer, start, start + k.shape[2], q, k, v, mask, (out, lse), offloaded)
        return out if lse is None else (out, lse)

    def _attend_on_gpu(self, layer, start, mask, q, k, v) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode attention of the GPU rows, in place; returns the output (q's shape) and, with
        ``merges``, its log-sum-exp, whose other rows the caller fills."""
        out, lse = torch.empty_like(q), lse_like(q, self.merges)
        self._attend_resident(layer, start + k.shape[2], q, mask, (out, lse), (start, k, v))
        return out, lse

    def _attend_resident(self, layer: int, end: int, q, mask, outputs, new=None) -> None:
        """Attention of the GPU rows over their slots up to ``end``, into ``outputs`` (the output,
        and the log-sum-exp or None); ``new`` (start, k, v): the step's slot, stored first."""
        for group in self.groups:
            if group.tier == "gpu":
                if new is not None:
                    start, k, v = new
                    group.put(layer, start, k[group.rows], v[group.rows])
                keys, values = (group.read(buffer, end, out=space)
                                for buffer, space in zip(group.pair(layer), self._dequantized()))
                attend_rows(*outputs, group.rows, q[group.rows], keys, values, mask[group.rows])

    def attends_on_cpu(self, start: int) -> bool:
        """Whether a step from slot ``start`` runs attention on the CPU (decode, with rows off the GPU)."""
        return start > 0 and self.decodes_on_host

    def attend_later(self, layer: int, start: int, mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> Callable[[], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """Start a decode step's attention with CPU attention; returns ``finish()``, which gives the
        output (q's shape) on the device (with ``merges``, and its log-sum-exp).

        GPU rows attend now. The worker stores the other rows' new slot and attends for them on the
        CPU while the main thread goes on enqueuing other batches' GPU work; ``finish`` waits for it
        and enqueues the read of its output. The output lands in one pinned buffer per batch: the
        batch's next job waits for an event recorded after that read was enqueued, so it never
        overwrites an output still in flight.
        """
        out, lse = self._attend_on_gpu(layer, start, mask, q, k, v)
        return self._attend_on_host(layer, start + k.shape[2], q, mask, (out, lse), self._offloaded(), (start, k, v))

    def _attend_on_host(self, layer: int, end: int, q, mask, outputs, offloaded, new=None):
        """CPU attention of the ``offloaded`` rows over their slots up to ``end`` on the host
        worker, landing in this cache's pinned buffers; ``new`` (start, k, v): the step's slot,
        stored by the worker first. Returns ``finish()``: the output (and log-sum-exp) filled."""
        out, lse = outputs
        rows = slice(offloaded[0].rows.start, offloaded[-1].rows.stop)
        shape = (rows.stop - rows.start, *q.shape[1:])
        if self._landing is None or self._landing[0].shape != shape:
            self._landing = (self.host.empty(shape, q.dtype),
                             self.host.empty((*shape[:-1], 1), torch.float32) if lse is not None else None)
        landing, landing_lse = self._landing

        def attend() -> None:
            # Blocking copies, on the worker's store stream: only the worker waits for them.
            queries, allowed = q[rows].to("cpu", self.dtype), mask[rows].cpu()
            for group in offloaded:
                if new is None:
                    group.load(layer, end)
                else:
                    start, k, v = new
                    group.load(layer, start)
                    group.put(layer, start, k[group.rows], v[group.rows], self.worker.copy_to_host, staged=True)
                keys, values = group.pair(layer)
                local = slice(group.rows.start - rows.start, group.rows.stop - rows.start)
                cpu_attention(queries[local], partial(group.read, keys, end), partial(group.read, values, end),
                              allowed[local], out=landing[local],
                              lse=None if landing_lse is None else landing_lse[local])

        job = self.worker.submit(attend, self.streams.record(self.streams.compute))

        def finish():
            job.result()
            read_pinned(out[rows], landing)
            if lse is None:
                return out
            read_pinned(lse[rows], landing_lse)
            return out, lse

        return finish

    def _attend_loaded(self, layer, start, end, q, k, v, mask, outputs, offloaded) -> None:
        """GPU attention for off-GPU rows, on the slots ``prefetch`` loaded into the workspace, into
        ``outputs`` (the output, and the log-sum-exp or None); the new slot then goes home."""
        index, runs = self._attend_workspace(layer, end, q, mask, outputs, offloaded, (start, k, v))
        streamed = [group for group in offloaded if self._on_store_stream(group)]
        if streamed:
            self._send_slot(layer, start, runs, streamed, index)
        on_disk = [group for group in offloaded if group.tier == "disk"]
        if on_disk:
            self._send_to_disk(layer, start, runs, on_disk, index)
        others = [group for group in offloaded if group not in streamed and group not in on_disk]
        if others:
            self._store(layer, start, k, v, others)

    def _attend_workspace(self, layer: int, end: int, q, mask, outputs, offloaded, new=None):
        """Attention of the ``offloaded`` rows over their slots up to ``end`` in the workspace set
        their layer's load filled (``new`` (start, k, v): the step's slot, written in first), into
        ``outputs``; the set is free again once it ran. Returns the set and each tier's run of it."""
        index, ready, from_disk = self._state[layer].take_load()
        self.streams.wait(self.streams.compute, ready)
        if from_disk is not None:
            self.streams.wait(self.streams.compute, from_disk.result())
        first = offloaded[0].rows.start
        runs = {group: self._workspace_rows(index, group, first) for group in offloaded}  # a run of the set a tier
        for group, loaded in runs.items():
            if new is not None:
                start, k, v = new
                SLOT_MAJOR.write_pair(self.fmt, loaded, start, k[group.rows], v[group.rows])
            keys, values = (SLOT_MAJOR.read(self.fmt, buffer, end, out=space)
                            for buffer, space in zip(loaded, self._dequantized()))
            attend_rows(*outputs, group.rows, q[group.rows], keys, values, mask[group.rows])
        self.workspace.free_events[index] = self.streams.record(self.streams.compute)
        return index, runs

    def _send_slot(self, layer: int, start: int, runs: dict, groups: list[TierRows], index: int) -> None:
        """Copy the new slot of slot-major CPU rows home from their ``runs`` of workspace set
        ``index``, where it was just encoded (so it is not encoded twice), on the store stream after
        the attention. The set is reloaded only after these copies, and the layer's next load waits
        for them."""
        streams = self.streams
        streams.wait(streams.store, streams.record(streams.compute))
        with streams.on(streams.store):
            for group in groups:
                for source, home in zip(runs[group], group.pair(layer)):
                    slot = source.narrow(0, start, 1)
                    for part, target in zip(self.fmt.parts(slot), self.fmt.parts(home.narrow(0, start, 1))):
                        target.copy_(part, non_blocking=True)
        stored = self.workspace.free_events[index] = streams.record(streams.store)
        self._state[layer].streamed(stored)

    def _send_to_disk(self, layer: int, start: int, runs: dict, groups: list[TierRows], index: int) -> None:
        """Send disk rows' new slot home from their ``runs`` of workspace set ``index``, where it was
        just encoded: copied on the store stream into a one-slot host pair of each group's ring,
        then written to the files by the worker once the copies have passed. The worker's job is a
        wait and the writes: the fewer the worker's calls into torch, the less it holds the
        interpreter the main thread needs to keep the GPU fed."""
        streams = self.streams
        streams.wait(streams.store, streams.record(streams.compute))
        taken = []
        with streams.on(streams.store):
            for group in groups:
                ring_index, pair = group.take_slot_pair()
                for source, target in zip(runs[group], pair):
                    for part, into in zip(self.fmt.parts(source.narrow(0, start, 1)), self.fmt.parts(target)):
                        into.copy_(part, non_blocking=True)
                taken.append((group, ring_index))
        copied = self.workspace.free_events[index] = streams.record(streams.store)

        def write() -> None:
            if copied is not None:
                copied.synchronize()
            for group, ring_index in taken:
                group.write_slot(layer, start, ring_index)

        job = self.worker.submit(write, None)
        self._state[layer].wrote(job)
        for group, ring_index in taken:
            group.wrote_slot_pair(ring_index, job)

    def nbytes_by_tier(self) -> dict[str, int]:
        """Bytes of this batch's cache per tier (compressed bytes where the cache is compressed),
        with disk rows' host staging. The block's shared KVWorkspace counts its own."""
        sizes = dict.fromkeys(TIERS, 0)
        for group in self.groups:
            for tier, size in group.nbytes_by_tier().items():
                sizes[tier] += size
        return sizes
