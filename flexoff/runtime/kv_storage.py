"""How a KV buffer is laid out and encoded: the parts the cache's groups are built from.

A buffer holds one layer's keys (or values) for some rows of a batch. Its layout says in which
order the dimensions are stored; its format says how values are encoded: plain, in the compute
dtype, or quantized group-wise along head_dim (the last dimension) by :mod:`flexoff.compression`.
Buffers of both formats answer ``narrow`` and ``copy_``, and each format answers ``empty``,
``write``, ``decode`` and ``parts``, so the cache never asks which format it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compression import CompressedTensor, compressed_nbytes, dequantize, quantize
from ..policy import CompressionConfig

# allocate(shape, dtype) -> an uninitialised tensor on the buffer's tier
Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
# copy_across(target, source): fill a tensor from one of the same shape on another device
CopyAcross = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class Layout:
    """A storage order of the standard (rows, kv_heads, slots, head_dim): dimension ``i`` of the
    buffer is standard dimension ``order[i]``. head_dim always stays last, where groups run."""

    order: tuple[int, int, int, int]

    @property
    def slot_dim(self) -> int:
        return self.order.index(2)

    @property
    def row_dim(self) -> int:
        return self.order.index(0)

    def shape(self, slots: int, rows: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        standard = (rows, kv_heads, slots, head_dim)
        return tuple(standard[d] for d in self.order)

    def arrange(self, x: torch.Tensor) -> torch.Tensor:
        """A standard-order tensor viewed in this layout's order."""
        return x.permute(self.order)

    def standard(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor in this layout's order viewed as (rows, kv_heads, slots, head_dim)."""
        return x.permute(tuple(self.order.index(d) for d in range(4)))

    def write(self, fmt: "PlainFormat | QuantizedFormat", buffer, start: int, x: torch.Tensor,
              copy_across: CopyAcross | None = None) -> None:
        """Store x (rows, kv_heads, seq, head_dim) at slots [start, start + seq)."""
        fmt.write(buffer.narrow(self.slot_dim, start, x.shape[2]), self.arrange(x), copy_across)

    def write_pair(self, fmt: "PlainFormat | QuantizedFormat", pair: tuple, start: int, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """Store k and v (rows, kv_heads, seq, head_dim) at slots [start, start + seq) of ``pair``'s
        (keys, values), buffers on the device where k and v are."""
        keys, values = (buffer.narrow(self.slot_dim, start, k.shape[2]) for buffer in pair)
        fmt.fill_pair(keys, values, self.arrange(k), self.arrange(v))

    def read(self, fmt: "PlainFormat | QuantizedFormat", buffer, end: int, rows: slice | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Slots [0, end) of ``rows`` (all rows by default) as (rows, kv_heads, end, head_dim) in the
        compute dtype: a view of a plain buffer; for a compressed one, decompressed into the flat
        workspace ``out``, or into a new tensor."""
        part = buffer.narrow(self.slot_dim, 0, end)
        if rows is not None:
            part = part.narrow(self.row_dim, rows.start, rows.stop - rows.start)
        return self.standard(fmt.decode(part, out))


# Caches that travel: the first n slots of all rows are one contiguous run, so a step's load is
# one copy or one file read (per part of a compressed buffer).
SLOT_MAJOR = Layout((2, 0, 1, 3))
# A CPU cache that CPU attention reads in place: each head's keys are contiguous. Strided keys ran
# CPU attention at a third of its memory bandwidth.
ROW_MAJOR = Layout((0, 1, 2, 3))


def carve(part: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """Rows [offset, offset + count) of a slot-major (slots, rows, ...) part's storage as a
    contiguous (slots, count, ...) tensor of their own: a run of the flat storage, not a narrowed
    view. Runs for disjoint rows are disjoint, and a copy into one is a single memcpy."""
    inner = part[0, 0].numel()
    run = part.view(-1).narrow(0, part.shape[0] * offset * inner, part.shape[0] * count * inner)
    return run.view(part.shape[0], count, *part.shape[2:])


class _Format:
    def write(self, target, x: torch.Tensor, copy_across: CopyAcross | None = None) -> None:
        """Store x into ``target`` (the same shape, in the compute dtype, maybe on another device);
        ``copy_across(target_part, source_part)`` moves each encoded part between the devices. The
        default is a plain copy: strided host targets (a row-major CPU cache) are written by the
        host worker, which passes its pinned staged copy."""
        if x.device == target.device:
            self.fill(target, x)
            return
        # Encode where x is, so that only the encoded bytes cross between devices.
        for part, source in zip(self.parts(target), self.parts(self.encode(x))):
            (copy_across or torch.Tensor.copy_)(part, source)

    def size_of(self, buffer) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts(buffer))

    def fill_pair(self, keys, values, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k into ``keys`` and v into ``values`` (on their device)."""
        self.fill(keys, k)
        self.fill(values, v)


class PlainFormat(_Format):
    """Values kept as they are, in the compute dtype."""

    compressed = False

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def empty(self, shape: tuple[int, ...], allocate: Allocate) -> torch.Tensor:
        return allocate(shape, self.dtype)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        return math.prod(shape) * self.dtype.itemsize

    def empty_pair(self, shape: tuple[int, ...], allocate: Allocate) -> tuple[torch.Tensor, torch.Tensor]:
        both = allocate((2, *shape), self.dtype)
        return both[0], both[1]

    @staticmethod
    def parts(buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (buffer,)

    @staticmethod
    def encode(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def carve(buffer: torch.Tensor, offset: int, count: int) -> torch.Tensor:
        return carve(buffer, offset, count)

    @staticmethod
    def fill(target: torch.Tensor, x: torch.Tensor) -> None:
        target.copy_(x)

    @staticmethod
    def decode(source: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return source  # attention reads a plain cache in place


class QuantizedFormat(_Format):
    """Values quantized group-wise along head_dim: packed codes, per-group scales and minimums."""

    compressed = True

    def __init__(self, config: CompressionConfig, dtype: torch.dtype):
        self.bits = config.bits
        self.group_size = config.group_size
        self.dtype = dtype

    def empty(self, shape: tuple[int, ...], allocate: Allocate) -> CompressedTensor:
        # The meta device gives the parts' shapes without allocating; the tier allocates them
        # (host memory comes from slabs, which CompressedTensor.empty would bypass).
        meta = CompressedTensor.empty(shape, self.dtype, self.bits, self.group_size, -1, device="meta")
        data, scale, minimum = (allocate(tuple(p.shape), p.dtype) for p in self.parts(meta))
        return CompressedTensor(data, scale, minimum, shape, self.dtype, -1, self.bits, self.group_size)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        return compressed_nbytes(shape, self.bits, self.group_size, -1, self.dtype)

    def empty_pair(self, shape: tuple[int, ...], allocate: Allocate) -> tuple[CompressedTensor, CompressedTensor]:
        """(keys, values) of ``shape``, each part of the two one allocation with the keys first, so
        that ``fill_pair`` encodes a slot of both in one call."""
        both = self.empty((2, *shape), allocate)
        return tuple(CompressedTensor(*(p[i] for p in self.parts(both)), shape, self.dtype, -1, self.bits,
                                      self.group_size) for i in range(2))

    def fill_pair(self, keys: CompressedTensor, values: CompressedTensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Where the two targets are the same views of one allocation (``empty_pair``'s halves,
        narrowed alike), one quantize call over both, as one strided target: on CUDA one launch
        instead of two, in a decode step's attention of every travelling batch and layer."""
        both = _stacked(self.parts(keys), self.parts(values))
        if both is None:
            super().fill_pair(keys, values, k, v)
            return
        # the same layout behind a new leading dimension: no checks
        target = keys._with_parts(*both, shape=(2, *keys.shape), dim=keys.dim + 1)
        quantize(torch.stack((k, v)), self.bits, self.group_size, -1, out=target)

    @staticmethod
    def parts(buffer: CompressedTensor) -> tuple[torch.Tensor, ...]:
        return (buffer.data, buffer.scale, buffer.minimum)

    def encode(self, x: torch.Tensor) -> CompressedTensor:
        return quantize(x, self.bits, self.group_size, -1)

    def carve(self, buffer: CompressedTensor, offset: int, count: int) -> CompressedTensor:
        shape = (buffer.shape[0], count, *buffer.shape[2:])
        return CompressedTensor(*(carve(p, offset, count) for p in self.parts(buffer)), shape, self.dtype, -1,
                                self.bits, self.group_size)

    def fill(self, target: CompressedTensor, x: torch.Tensor) -> None:
        quantize(x, self.bits, self.group_size, -1, out=target)

    @staticmethod
    def decode(source: CompressedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None:
            out = out[:source.numel()].view(source.shape)  # contiguous, as the fused kernel wants
        return dequantize(source, out=out)


def _stacked(first: tuple[torch.Tensor, ...], second: tuple[torch.Tensor, ...]) -> list[torch.Tensor] | None:
    """Each pair of parts as one (2, *shape) view of their storage, where the second lies at the
    same positive distance after the first in each; None where they do not."""
    stacked = []
    for a, b in zip(first, second):
        distance = b.storage_offset() - a.storage_offset()
        if (a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or distance <= 0
                or a.shape != b.shape or a.stride() != b.stride()):
            return None
        stacked.append(a.as_strided((2, *a.shape), (distance, *a.stride()), a.storage_offset()))
    return stacked


def kv_format(config: CompressionConfig | None, dtype: torch.dtype) -> PlainFormat | QuantizedFormat:
    """The format of a cache in compute dtype ``dtype``, compressed when ``config`` is set."""
    return PlainFormat(dtype) if config is None else QuantizedFormat(config, dtype)
