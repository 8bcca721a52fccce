"""The compressed tensor container and its storage formula.

Layout. The grouped dimension ``dim`` is moved last; every other dimension keeps its order and
indexes a "row". For an original shape ``S`` with ``D = S[dim]`` and ``G = ceil(D / group_size)``:

- ``data``:    (*S without dim, packed_row_bytes(D, bits)) uint8, the packed codes of each row;
- ``scale``:   (*S without dim, G), in the tensor's ``dtype``;
- ``minimum``: (*S without dim, G), in the tensor's ``dtype``.

Value ``j`` of a row belongs to group ``j // group_size`` and decodes as
``code * scale[group] + minimum[group]``, computed in fp32 and rounded once to the output dtype.
Because rows keep the original order of the other dimensions, slicing along any of them (a batch
or sequence range of a KV cache) is a plain slice of all three tensors.

Scale and minimum are stored in the input's dtype (fp16 -> fp16, bf16 -> bf16, fp32 -> fp32): the
minimum is then exact, and bf16's range needs no fp16 overflow handling. ``dtype`` is theirs, which
a tensor may take apart from its values' (a checkpoint's fp16 scales under bf16 compute: see
``quantize``'s ``meta_dtype``); dequantizing into an ``out`` of any supported dtype computes in
fp32 from them and rounds once to ``out``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import FlexoffError
from ..policy import SUPPORTED_BITS, CompressionConfig
from .packing import packed_row_bytes

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class CompressionError(FlexoffError):
    """Compression settings or inputs the codec cannot handle."""


def check_settings(bits: int, group_size: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise CompressionError(f"{bits!r}-bit compression is not supported; use one of {SUPPORTED_BITS}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
        raise CompressionError(f"compression group size must be an integer >= 2, got {group_size!r}")


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise CompressionError(f"cannot compress a {str(dtype).removeprefix('torch.')} tensor; use one of {names}")


def normalize_dim(dim: int, ndim: int) -> int:
    if ndim == 0:
        raise CompressionError("cannot compress a 0-dimensional tensor: there is no dimension to group along")
    if not -ndim <= dim < ndim:
        raise CompressionError(f"group dimension {dim} is out of range for a {ndim}-dimensional tensor")
    return dim % ndim


def compressed_nbytes(
    shape: Sequence[int],
    bits: int,
    group_size: int,
    dim: int = -1,
    dtype: torch.dtype = torch.float16,
) -> int:
    """Bytes a tensor of ``shape`` and ``dtype`` occupies once compressed.

    ``rows * (packed_row_bytes(D, bits) + 2 * G * dtype_bytes)`` where ``D = shape[dim]``,
    ``G = ceil(D / group_size)`` and ``rows`` is the product of the other dimensions.
    ``packed_row_bytes`` is ``ceil(D * bits / 8)`` for 2, 4 and 8 bits, and
    ``3 * ceil(D / 8)`` for 3 bits. At 4 bits, group 64, fp16: 4.5 bits per value.
    """
    check_settings(bits, group_size)
    check_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    dim = normalize_dim(dim, len(shape))
    size = shape[dim]
    rows = math.prod(shape[:dim] + shape[dim + 1:])
    groups = -(-size // group_size)
    meta_bytes = torch.empty((), dtype=dtype).element_size()
    return rows * (packed_row_bytes(size, bits) + 2 * groups * meta_bytes)


class CompressedTensor:
    """A group-wise quantized tensor: packed codes plus per-group scale and minimum.

    Build one with :func:`flexoff.compression.quantize` or :meth:`empty`; the constructor checks
    that the parts agree, so it can also rebuild one that was stored part by part.
    """

    __slots__ = ("data", "scale", "minimum", "shape", "dtype", "dim", "bits", "group_size")

    def __init__(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype,
        dim: int,
        bits: int,
        group_size: int,
    ):
        check_settings(bits, group_size)
        check_dtype(dtype)
        self.shape = torch.Size(shape)
        self.dim = normalize_dim(dim, len(self.shape))
        self.dtype = dtype
        self.bits = bits
        self.group_size = group_size
        rows_shape = self.rows_shape
        expect_data = rows_shape + (self.bytes_per_row,)
        expect_meta = rows_shape + (self.num_groups,)
        if data.dtype != torch.uint8 or tuple(data.shape) != expect_data:
            raise CompressionError(
                f"packed data must be uint8 of shape {expect_data}, got {data.dtype} {tuple(data.shape)}"
            )
        for name, part in (("scale", scale), ("minimum", minimum)):
            if part.dtype != dtype or tuple(part.shape) != expect_meta:
                raise CompressionError(
                    f"{name} must be {dtype} of shape {expect_meta}, got {part.dtype} {tuple(part.shape)}"
                )
            if part.device != data.device:
                raise CompressionError(f"{name} is on {part.device} but the packed data is on {data.device}")
        self.data = data
        self.scale = scale
        self.minimum = minimum

    @classmethod
    def empty(
        cls,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float16,
        bits: int = 4,
        group_size: int = 64,
        dim: int = -1,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> "CompressedTensor":
        """Uninitialised storage, e.g. a compressed KV cache that :func:`quantize` fills by slices."""
        check_settings(bits, group_size)
        check_dtype(dtype)
        shape = torch.Size(shape)
        dim = normalize_dim(dim, len(shape))
        rows_shape = shape[:dim] + shape[dim + 1:]
        groups = -(-shape[dim] // group_size)
        pin = pin_memory and torch.cuda.is_available() and torch.device(device).type == "cpu"
        data = torch.empty(
            rows_shape + (packed_row_bytes(shape[dim], bits),), dtype=torch.uint8, device=device, pin_memory=pin
        )
        scale = torch.empty(rows_shape + (groups,), dtype=dtype, device=device, pin_memory=pin)
        minimum = torch.empty(rows_shape + (groups,), dtype=dtype, device=device, pin_memory=pin)
        return cls(data, scale, minimum, shape, dtype, dim, bits, group_size)

    @property
    def rows_shape(self) -> torch.Size:
        """The original shape without the grouped dimension."""
        return self.shape[: self.dim] + self.shape[self.dim + 1:]

    @property
    def group_dim_size(self) -> int:
        return self.shape[self.dim]

    @property
    def num_groups(self) -> int:
        return -(-self.group_dim_size // self.group_size)

    @property
    def bytes_per_row(self) -> int:
        return packed_row_bytes(self.group_dim_size, self.bits)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def config(self) -> CompressionConfig:
        return CompressionConfig(bits=self.bits, group_size=self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes of real storage: packed codes plus scales and minimums."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.minimum))

    def numel(self) -> int:
        return self.shape.numel()

    def _with_parts(self, data, scale, minimum, shape=None, dim=None) -> "CompressedTensor":
        """The same layout over other parts, made from this tensor's by a view or a copy, so they
        agree with it by construction: no checks (a cache layer's attention takes a dozen views).
        ``dim``: the grouped dimension where ``shape`` adds dimensions before it."""
        other = object.__new__(CompressedTensor)
        other.data, other.scale, other.minimum = data, scale, minimum
        other.shape = self.shape if shape is None else torch.Size(shape)
        other.dtype, other.bits, other.group_size = self.dtype, self.bits, self.group_size
        other.dim = self.dim if dim is None else dim
        return other

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "CompressedTensor":
        parts = (t.to(device, non_blocking=non_blocking) for t in (self.data, self.scale, self.minimum))
        return self._with_parts(*parts)

    def pin_memory(self) -> "CompressedTensor":
        """A page-locked copy for fast, asynchronous host-to-GPU copies; unchanged without CUDA."""
        if not torch.cuda.is_available() or self.device.type != "cpu":
            return self
        return self._with_parts(self.data.pin_memory(), self.scale.pin_memory(), self.minimum.pin_memory())

    def is_pinned(self) -> bool:
        return self.device.type == "cpu" and torch.cuda.is_available() and self.data.is_pinned()

    def copy_(self, source: "CompressedTensor", non_blocking: bool = False) -> "CompressedTensor":
        """Copy another compressed tensor of the same layout into this one's storage (any devices)."""
        same = (source.shape, source.dtype, source.dim, source.bits, source.group_size) == (
            self.shape, self.dtype, self.dim, self.bits, self.group_size
        )
        if not same:
            raise CompressionError(f"cannot copy {source!r} into {self!r}: the layouts differ")
        self.data.copy_(source.data, non_blocking=non_blocking)
        self.scale.copy_(source.scale, non_blocking=non_blocking)
        self.minimum.copy_(source.minimum, non_blocking=non_blocking)
        return self

    def narrow(self, dim: int, start: int, length: int) -> "CompressedTensor":
        """A view of ``length`` entries from ``start`` along ``dim`` (not the grouped dimension).

        The view shares storage, so :func:`quantize` with ``out=`` can fill a slice of a larger
        compressed tensor in place.
        """
        if not 0 <= dim < len(self.shape):  # the cache's many views name their dimension as it is
            dim = normalize_dim(dim, len(self.shape))
        if dim == self.dim:
            raise CompressionError(
                f"cannot slice a compressed tensor along its grouped dimension {dim}; "
                "dequantize it first, or group along another dimension"
            )
        size = self.shape[dim]
        if start < 0 or length < 0 or start + length > size:
            raise CompressionError(f"slice [{start}, {start + length}) is out of range for size {size} along dim {dim}")
        row_dim = dim if dim < self.dim else dim - 1
        shape = list(self.shape)
        shape[dim] = length
        return self._with_parts(self.data.narrow(row_dim, start, length), self.scale.narrow(row_dim, start, length),
                                self.minimum.narrow(row_dim, start, length), shape=shape)

    def __repr__(self) -> str:
        return (
            f"CompressedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, dim={self.dim}, "
            f"bits={self.bits}, group_size={self.group_size}, device={self.device}, nbytes={self.nbytes})"
        )
