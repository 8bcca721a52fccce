"""What a batch's KV cache is built from: the rows of one tier with their storage for every layer
(:class:`ResidentRows` on the GPU or host, :class:`DiskRows` in files, both :class:`TierRows`), and
the GPU workspace a block's batches share (:class:`KVWorkspace`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..layout import DISK_SLOT_RING, Piece, WorkspaceLayout, workspace_layout
from ..models import ModelConfig
from ..policy import Policy
from .kv_storage import ROW_MAJOR, SLOT_MAJOR, PlainFormat, QuantizedFormat, kv_format
from .tiers import DiskTier, HostMemory, Streams, device_allocator, host_bytes


class KVWorkspace:
    """GPU buffers shared by the batches of a block.

    ``sets``: off-GPU rows that travel for GPU attention are loaded here, in the cache's format (so
    a compressed cache crosses PCIe compressed); a ring of two, so the next batch loads while this
    one computes. ``dequantized``: with a compressed cache, a flat (keys, values) pair that one
    attention call's slots are decompressed into; one pair serves every call, since attention runs
    in order on the compute stream.
    """

    def __init__(self, cfg: ModelConfig, layout: WorkspaceLayout, fmt: PlainFormat | QuantizedFormat,
                 device: torch.device, dtype: torch.dtype, streams: Streams):
        allocate = device_allocator(device)
        shape = SLOT_MAJOR.shape(layout.slots, layout.travelling, cfg.num_kv_heads, cfg.head_dim)
        self.fmt = fmt
        self.sets = [fmt.empty_pair(shape, allocate) for _ in range(layout.ring_sets)]
        numel = layout.dequantized_numel
        self.dequantized = (allocate((numel,), dtype), allocate((numel,), dtype)) if numel else (None, None)
        self.free_events = [None] * len(self.sets)
        self.streams = streams
        self._next = 0
        # (set, offset, count) -> that run's (keys, values): a batch asks for the same runs at every
        # layer twice (to load, then to attend), and carving them anew cost the host about a tenth
        # of its time per layer and batch.
        self._runs: dict[tuple[int, int, int], tuple] = {}

    @classmethod
    def for_block(cls, cfg: ModelConfig, policy: Policy, rows: int, slots: int, device: torch.device,
                  dtype: torch.dtype, streams: Streams) -> "KVWorkspace | None":
        """The workspace for batches of up to ``rows`` sequences, or None where none is needed."""
        layout = workspace_layout(cfg, policy, rows, slots, dtype.itemsize)
        if layout is None:
            return None
        return cls(cfg, layout, kv_format(policy.compress_cache, dtype), device, dtype, streams)

    def take(self) -> int:
        index = self._next
        self._next = (self._next + 1) % len(self.sets)
        self.streams.wait(self.streams.cache, self.free_events[index])
        return index

    def rows(self, index: int, offset: int, count: int) -> tuple:
        """Set ``index``'s (keys, values) for travelling rows [offset, offset + count). Each tier's
        rows get a contiguous run of the set, so a load into it is one copy, with no kernel on the
        GPU to scatter a staged copy into strided rows."""
        key = (index, offset, count)
        runs = self._runs.get(key)
        if runs is None:
            runs = self._runs[key] = tuple(self.fmt.carve(buffer, offset, count) for buffer in self.sets[index])
        return runs

    @property
    def nbytes(self) -> int:
        ring = sum(self.fmt.size_of(buffer) for pair in self.sets for buffer in pair)
        return ring + sum(t.numel() * t.element_size() for t in self.dequantized if t is not None)


@dataclass(frozen=True)
class RowsHome:
    """What the rows of every tier of one batch are built from."""

    cfg: ModelConfig
    layers: Iterable[int]  # the decoder layers held here
    slots: int
    fmt: PlainFormat | QuantizedFormat
    device: torch.device
    host: HostMemory
    disk: DiskTier | None


class TierRows(ABC):
    """Rows of the batch that share a tier: what resident rows and disk rows have in common."""

    def __init__(self, piece: Piece, home: RowsHome, layout):
        self.tier = piece.tier
        self.rows = slice(piece.start, piece.stop)
        self.fmt = home.fmt
        self.layout = layout

    def _shape(self, home: RowsHome, slots: int) -> tuple:
        return self.layout.shape(slots, self.rows.stop - self.rows.start, home.cfg.num_kv_heads, home.cfg.head_dim)

    def _pair(self, shape: tuple, allocate) -> tuple:
        return self.fmt.empty(shape, allocate), self.fmt.empty(shape, allocate)

    @abstractmethod
    def pair(self, layer: int) -> tuple:
        """This layer's (keys, values) buffers on the host or GPU."""

    def load(self, layer: int, end: int) -> None:
        """Bring this layer's first ``end`` slots into ``pair(layer)``, where they are not already."""

    @abstractmethod
    def put(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor, copy_across=None,
            staged: bool = False) -> None:
        """Store keys and values (rows, kv_heads, seq, head_dim) at slots [start, start + seq).
        ``copy_across`` brings device tensors to the host. ``staged``: ``pair(layer)`` is the layer's
        loaded copy (disk rows), and gets the new slots too."""

    def read(self, buffer, end: int, rows: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.layout.read(self.fmt, buffer, end, rows, out)

    @abstractmethod
    def nbytes_by_tier(self) -> dict[str, int]:
        """Bytes of this rows' storage per tier."""


class ResidentRows(TierRows):
    """Rows whose storage for every layer stays in one place: GPU memory, or host memory (slot-major
    where the cache travels, row-major where CPU attention reads it in place)."""

    def __init__(self, piece: Piece, home: RowsHome, layout):
        super().__init__(piece, home, layout)
        allocate = device_allocator(home.device) if self.tier == "gpu" else home.host.empty
        shape = self._shape(home, home.slots)
        self.store = {j: self._pair(shape, allocate) for j in home.layers}

    def pair(self, layer: int) -> tuple:
        return self.store[layer]

    def put(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor, copy_across=None,
            staged: bool = False) -> None:
        for buffer, new in zip(self.store[layer], (keys, values)):
            self.layout.write(self.fmt, buffer, start, new, copy_across)

    def nbytes_by_tier(self) -> dict[str, int]:
        return {self.tier: sum(self.fmt.size_of(buffer) for pair in self.store.values() for buffer in pair)}


class DiskRows(TierRows):
    """Rows kept in two files per layer (keys and values, slot-major), which go through host buffers
    of their own: two staging pairs, even and odd layers, that reads fill (``pair``); an outbox for
    a prefill's slots; and a ring of one-slot pairs that a decode step's new slot goes home through."""

    def __init__(self, piece: Piece, home: RowsHome, name: str):
        super().__init__(piece, home, SLOT_MAJOR)
        shape, empty = self._shape(home, home.slots), home.host.empty
        # Two host staging pairs serve the layers, even and odd: a layer's slots are read in while
        # the layer before is copied out of the other. New slots are written out through a pair of
        # their own, since reads of other layers may be refilling the staging pairs meanwhile.
        self.staging = [self._pair(shape, empty) for _ in range(2)]
        # Per staging pair: the job that last copied out of it into the workspace, whose result
        # is the copy's event (None on the CPU). The main thread alone sets and reads it.
        self.copied_out: list[Future | None] = [None, None]
        self.outbox = self._pair(shape, empty)
        self.slot_ring = [self._pair(self._shape(home, 1), empty) for _ in range(DISK_SLOT_RING)]
        self._ring_writes: list = [None] * DISK_SLOT_RING  # each pair's last write to the files (a Future)
        self._ring_next = 0
        # A file holds the buffer's parts (the values; or codes, scales and minimums) one after
        # another, each slot-major, so the first n slots are one read per part. The staging pairs
        # and the ring are read and written on helper threads at every step: their parts' bytes
        # are viewed once, here.
        self.slot_nbytes = [part[0].numel() * part.element_size() for part in self.fmt.parts(self.outbox[0])]
        self._staging_bytes = [self._part_bytes(pair) for pair in self.staging]
        self._ring_bytes = [self._part_bytes(pair) for pair in self.slot_ring]
        self.sections = [home.slots * sum(self.slot_nbytes[:i]) for i in range(len(self.slot_nbytes))]
        size = home.slots * sum(self.slot_nbytes)
        self.files = {j: (home.disk.allocate(f"{name}.layer{j}.k", size),
                          home.disk.allocate(f"{name}.layer{j}.v", size)) for j in home.layers}

    def _part_bytes(self, pair: tuple) -> list[list[memoryview]]:
        return [[host_bytes(part) for part in self.fmt.parts(buffer)] for buffer in pair]

    def pair(self, layer: int) -> tuple:
        """The layer's staging pair, which holds what was last read (or put, staged) of the layers
        of its parity."""
        return self.staging[layer % 2]

    def load(self, layer: int, end: int) -> None:
        """Read this layer's first ``end`` slots from the files into its staging pair."""
        if end == 0:
            return
        for region, parts in zip(self.files[layer], self._staging_bytes[layer % 2]):
            for part, offset, slot_nbytes in zip(parts, self.sections, self.slot_nbytes):
                region.read_bytes(part[:end * slot_nbytes], offset)

    def put(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor, copy_across=None,
            staged: bool = False) -> None:
        """Encode the slots into the outbox and write them to the layer's files."""
        end = start + keys.shape[2]
        for buffer, new in zip(self.outbox, (keys, values)):
            self.layout.write(self.fmt, buffer, start, new, copy_across)
        for region, buffer, staging in zip(self.files[layer], self.outbox, self.pair(layer)):
            for part, offset, slot_nbytes in zip(self.fmt.parts(buffer), self.sections, self.slot_nbytes):
                region.write(part[start:end], offset + start * slot_nbytes)
            if staged:
                staging.narrow(0, start, end - start).copy_(buffer.narrow(0, start, end - start))

    def take_slot_pair(self) -> tuple:
        """(index, pair) of the next one-slot pair of the ring, once its last write has finished."""
        index = self._ring_next
        self._ring_next = (index + 1) % len(self.slot_ring)
        last = self._ring_writes[index]
        if last is not None:
            last.result()
        return index, self.slot_ring[index]

    def wrote_slot_pair(self, index: int, job) -> None:
        """``job`` (a Future) writes ring pair ``index`` to the files; the pair waits for it."""
        self._ring_writes[index] = job

    def write_slot(self, layer: int, start: int, index: int) -> None:
        """Write ring pair ``index`` (this layer's new keys and values, encoded) to slot ``start`` of
        the layer's files."""
        for region, parts in zip(self.files[layer], self._ring_bytes[index]):
            for part, offset, slot_nbytes in zip(parts, self.sections, self.slot_nbytes):
                region.write_bytes(part, offset + start * slot_nbytes)

    def nbytes_by_tier(self) -> dict[str, int]:
        return {"disk": sum(r.num_bytes for pair in self.files.values() for r in pair),
                "cpu": sum(self.fmt.size_of(buffer)
                           for pair in (*self.staging, self.outbox, *self.slot_ring) for buffer in pair)}


def tier_rows(piece: Piece, home: RowsHome, cpu_attention: bool, name: str) -> TierRows:
    """The rows of ``piece``'s tier: CPU rows are row-major where CPU attention reads them in place."""
    if piece.tier == "disk":
        return DiskRows(piece, home, name)
    return ResidentRows(piece, home, ROW_MAJOR if piece.tier == "cpu" and cpu_attention else SLOT_MAJOR)


def own_rows(x: torch.Tensor, group: TierRows) -> torch.Tensor:
    """The group's rows of x, to be kept alive until a host store has copied them. Rows cut out of
    the batch are copied, or their views would keep the whole layer's keys alive (several GB at
    prefill for a large batch with few rows off the GPU)."""
    return x if group.rows == slice(0, x.shape[0]) else x[group.rows].clone()


def copy_async(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source, non_blocking=True)
