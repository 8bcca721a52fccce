"""The KV cache of one GPU batch, split by rows (sequences) across gpu, cpu and disk.

Caches that travel are stored slot-major, (slots, rows, kv_heads, head_dim), so the first ``n``
slots of all rows are one contiguous run: one copy or one file read per step. A CPU cache that CPU
attention reads in place is stored row-major, (rows, kv_heads, slots, head_dim), so each head's
keys are contiguous: strided keys ran CPU attention at a third of its memory bandwidth.

Rows on the GPU attend in place. Rows elsewhere either travel to a GPU workspace each decode step,
or, with CPU attention, stay put: only the queries and outputs cross PCIe, and attention runs on
the CPU in the cache's dtype, a few sequences at a time.
"""

from __future__ import annotations

import torch

from ..models import ModelConfig
from ..models.common import attention
from .placement import Piece, split_rows
from .policy import Policy
from .tiers import DiskTier, HostMemory, Streams

CPU_ATTENTION_ROWS = 32  # sequences per CPU attention call: bounds its temporary memory


class SlotMajor:
    """(slots, rows, kv_heads, head_dim): a prefix of slots is one contiguous block."""

    @staticmethod
    def shape(slots: int, rows: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (slots, rows, kv_heads, head_dim)

    @staticmethod
    def view(buffer: torch.Tensor, end: int) -> torch.Tensor:
        """The first ``end`` slots as (rows, kv_heads, end, head_dim)."""
        return buffer[:end].permute(1, 2, 0, 3)

    @staticmethod
    def write(buffer: torch.Tensor, start: int, x: torch.Tensor) -> None:
        """Store x (rows, kv_heads, seq, head_dim) at slots [start, start + seq)."""
        buffer[start:start + x.shape[2]].copy_(x.permute(2, 0, 1, 3))


class RowMajor:
    """(rows, kv_heads, slots, head_dim): each head's keys are contiguous."""

    @staticmethod
    def shape(slots: int, rows: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (rows, kv_heads, slots, head_dim)

    @staticmethod
    def view(buffer: torch.Tensor, end: int) -> torch.Tensor:
        return buffer[:, :, :end]

    @staticmethod
    def write(buffer: torch.Tensor, start: int, x: torch.Tensor) -> None:
        # A strided host destination must not be filled straight from the GPU: that copy runs as
        # a kernel touching host memory element by element. Bring x over whole, then place it.
        buffer[:, :, start:start + x.shape[2]].copy_(x.to(buffer.device))


def cpu_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention on host tensors, chunked over sequences so no copy of the whole cache is made."""
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], CPU_ATTENTION_ROWS):
        rows = slice(start, start + CPU_ATTENTION_ROWS)
        out[rows] = attention(q[rows], keys[rows], values[rows], mask[rows])
    return out


class KVWorkspace:
    """GPU buffers into which off-GPU cache rows are loaded for GPU attention: a ring of two, so the
    next batch loads while this one computes."""

    def __init__(self, cfg: ModelConfig, slots: int, rows: int, device: torch.device, dtype: torch.dtype,
                 streams: Streams):
        shape = (slots, rows, cfg.num_kv_heads, cfg.head_dim)
        self.sets = [(torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))
                     for _ in range(2) if rows > 0]
        self.free_events = [None] * len(self.sets)
        self.streams = streams
        self._next = 0

    def take(self) -> int:
        index = self._next
        self._next = (self._next + 1) % len(self.sets)
        self.streams.wait(self.streams.load, self.free_events[index])
        return index

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.sets)


class _Group:
    """Rows of the batch that share a tier, with their storage for every layer."""

    def __init__(self, piece: Piece, cfg: ModelConfig, slots: int, device, dtype, host: HostMemory,
                 disk: DiskTier | None, cpu_attention: bool, name: str):
        self.tier = piece.tier
        self.rows = slice(piece.start, piece.stop)
        count = piece.stop - piece.start
        self.layout = RowMajor if self.tier == "cpu" and cpu_attention else SlotMajor
        shape = self.layout.shape(slots, count, cfg.num_kv_heads, cfg.head_dim)
        self.slot_numel = count * cfg.num_kv_heads * cfg.head_dim
        layers = range(cfg.num_layers)
        if self.tier == "gpu":
            self.store = [(torch.empty(shape, device=device, dtype=dtype),
                           torch.empty(shape, device=device, dtype=dtype)) for _ in layers]
        elif self.tier == "cpu":
            self.store = [(host.empty(shape, dtype), host.empty(shape, dtype)) for _ in layers]
        else:
            size = slots * self.slot_numel * dtype.itemsize
            self.files = [(disk.allocate(f"{name}.layer{j}.k", size), disk.allocate(f"{name}.layer{j}.v", size))
                          for j in layers]
            # One host staging pair serves every layer: a layer's slots are read in just before use.
            self.staging = (host.empty(shape, dtype), host.empty(shape, dtype))
        self.itemsize = dtype.itemsize

    def host_pair(self, layer: int, end: int, refresh: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tensors holding this layer's first ``end`` slots (read from disk if ``refresh``)."""
        if self.tier == "cpu":
            return self.store[layer]
        if refresh and end > 0:
            for region, buffer in zip(self.files[layer], self.staging):
                region.read_into(buffer[:end])
        return self.staging

    def write_back(self, layer: int, start: int, end: int) -> None:
        """Persist slots [start, end) of the staging pair to this layer's files (disk rows only)."""
        if self.tier == "disk":
            offset = start * self.slot_numel * self.itemsize
            for region, buffer in zip(self.files[layer], self.staging):
                region.write(buffer[start:end], offset)


class BatchKV:
    """The cache of one GPU batch; ``attend`` is what a layer calls to store and attend."""

    def __init__(self, cfg: ModelConfig, rows: int, slots: int, policy: Policy, device: torch.device,
                 dtype: torch.dtype, streams: Streams, disk: DiskTier | None, workspace: KVWorkspace | None,
                 host: HostMemory, name: str):
        self.cfg = cfg
        self.cpu_attention = policy.cpu_attention
        self.streams = streams
        self.device = device
        self.workspace = workspace
        self.groups = [_Group(p, cfg, slots, device, dtype, host, disk, policy.cpu_attention, f"{name}.{p.tier}")
                       for p in split_rows(rows, policy.cache)]
        self._loaded: dict[int, tuple[int, int]] = {}  # layer -> (workspace set, slots loaded)

    def _offloaded(self):
        return [g for g in self.groups if g.tier != "gpu"]

    def prefetch(self, layer: int, start: int) -> None:
        """Before a decode step: bring off-GPU rows' first ``start`` slots where attention will run."""
        groups = self._offloaded()
        if not groups or start == 0 or layer in self._loaded:
            return
        if self.cpu_attention:
            for group in groups:
                group.host_pair(layer, start, refresh=True)
            self._loaded[layer] = (-1, start)
            return
        index = self.workspace.take()
        keys, values = self.workspace.sets[index]
        with self.streams.on(self.streams.load):
            offset = 0
            for group in groups:
                count = group.rows.stop - group.rows.start
                host_k, host_v = group.host_pair(layer, start, refresh=True)
                keys[:start, offset:offset + count].copy_(host_k[:start], non_blocking=True)
                values[:start, offset:offset + count].copy_(host_v[:start], non_blocking=True)
                offset += count
        self._loaded[layer] = (index, start)
        self._ready_event = self.streams.record(self.streams.load)

    def attender(self, layer: int, start: int, mask: torch.Tensor):
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self._attend(layer, start, mask, q, k, v)

        return attend

    def _attend(self, layer, start, mask, q, k, v) -> torch.Tensor:
        end = start + k.shape[2]
        out = torch.empty_like(q)
        offloaded = self._offloaded()
        for group in self.groups:
            if group.tier == "gpu":
                keys, values = group.store[layer]
                SlotMajor.write(keys, start, k[group.rows])
                SlotMajor.write(values, start, v[group.rows])
                out[group.rows] = attention(q[group.rows], SlotMajor.view(keys, end), SlotMajor.view(values, end),
                                            mask[group.rows])
        if not offloaded:
            return out
        rows = slice(offloaded[0].rows.start, offloaded[-1].rows.stop)
        if start == 0:
            # Prefill: attend on the fresh keys, then send them to their tiers.
            out[rows] = attention(q[rows], k[rows], v[rows], mask[rows])
            self._store(layer, 0, end, k, v, offloaded)
        elif self.cpu_attention:
            self.prefetch(layer, start)
            self._store(layer, start, end, k, v, offloaded)
            for group in offloaded:
                host_k, host_v = group.host_pair(layer, end, refresh=False)
                part = cpu_attention(q[group.rows].to("cpu", host_k.dtype), group.layout.view(host_k, end),
                                     group.layout.view(host_v, end),
                                     mask[group.rows].cpu())
                out[group.rows] = part.to(self.device, non_blocking=True)
        else:
            self.prefetch(layer, start)
            index, _ = self._loaded[layer]
            self.streams.wait(self.streams.compute, self._ready_event)
            keys, values = self.workspace.sets[index]
            width = rows.stop - rows.start
            SlotMajor.write(keys[:, :width], start, k[rows])
            SlotMajor.write(values[:, :width], start, v[rows])
            out[rows] = attention(q[rows], SlotMajor.view(keys[:, :width], end),
                                  SlotMajor.view(values[:, :width], end), mask[rows])
            self.workspace.free_events[index] = self.streams.record(self.streams.compute)
            self._store(layer, start, end, k, v, offloaded)
        self._loaded.pop(layer, None)
        return out

    def _store(self, layer: int, start: int, end: int, k, v, groups) -> None:
        """Copy slots [start, end) of the offloaded rows to their host storage (and on to disk)."""
        for group in groups:
            host_k, host_v = group.host_pair(layer, end, refresh=False)
            group.layout.write(host_k, start, k[group.rows])
            group.layout.write(host_v, start, v[group.rows])
            group.write_back(layer, start, end)

    def nbytes_by_tier(self) -> dict[str, int]:
        sizes = {"gpu": 0, "cpu": 0, "disk": 0}
        for group in self.groups:
            if group.tier == "disk":
                sizes["disk"] += sum(r.num_bytes for pair in group.files for r in pair)
                sizes["cpu"] += sum(t.numel() * t.element_size() for t in group.staging)
            else:
                sizes[group.tier] += sum(t.numel() * t.element_size() for pair in group.store for t in pair)
        return sizes
