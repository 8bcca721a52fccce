"""Group-wise asymmetric min/max quantization (FlexGen §5), with real bit packing.

For each group of ``group_size`` consecutive values along ``dim``::

    levels  = 2**bits - 1
    minimum = min(group)                                   (stored in the tensor's dtype, exact)
    scale   = (max(group) - minimum) / levels              (in fp32, then rounded *up* to a
                                                            16-bit dtype)
    code    = clamp(round_half_even((x - minimum) / scale), 0, levels)      (0 where scale == 0)
    x'      = code * scale + minimum                       (fp32 multiply, fp32 add, one rounding
                                                            to the output dtype)

Scales and minimums take the tensor's dtype unless ``meta_dtype`` names another (a checkpoint's
fp16 scales under bf16 compute): the minimum is then rounded *down* into it, and the scale is
taken from that minimum, so every code still fits.

Rounding the stored scale up keeps every code inside ``[0, levels]`` without clipping, so each
value comes back within ``scale / 2`` of where it started (plus float rounding), and a constant
group comes back exactly. All arithmetic is separate IEEE fp32 operations (no fused multiply-add,
no reciprocal), so the CPU, CUDA and the Triton kernel agree bit for bit.

Work runs over blocks of rows (and, for very long rows, blocks of whole groups), so the fp32
temporaries stay at about ``chunk_elements`` values whatever the tensor's size: an fp16 tensor is
never copied to fp32 whole. On the CPU, dequantize decodes each block with :mod:`.cpu_kernels`
(contiguous vectorised passes, the same bits, about 2x faster). Values must be finite and a group's
range must fit fp32; the codec does not scan for NaN or inf, since that would cost a device sync per block on CUDA.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch

from . import cpu_kernels
from .cpu_kernels import Scratch
from .packing import bytes_per_unit, pack_codes, unpack_codes, values_per_unit
from .tensor import (
    CompressedTensor,
    CompressionError,
    check_dtype,
    check_settings,
    normalize_dim,
)

# Values widened to fp32 at a time. On a GPU, 4M values (16 MiB per temporary) amortise kernel
# launches; on the CPU, 1M keeps temporaries near the caches and measured about 1.5-3x faster.
DEFAULT_CHUNK_ELEMENTS = {"cuda": 1 << 22, "cpu": 1 << 20}


def _chunk(chunk_elements: int | None, device: torch.device) -> int:
    if chunk_elements is None:
        return DEFAULT_CHUNK_ELEMENTS.get(device.type, DEFAULT_CHUNK_ELEMENTS["cpu"])
    return chunk_elements


def _dequantize_chunk(chunk_elements: int | None, device: torch.device) -> int:
    """CPU dequantize: each op of a block is split across the threads, so the block grows with
    them (16 threads: 4M values ran 2.8x faster than 1M; 2 threads: 2M at least as fast as 1M)."""
    if chunk_elements is None and device.type == "cpu":
        return max(1 << 21, torch.get_num_threads() << 18)
    return _chunk(chunk_elements, device)


@torch.no_grad()
def quantize(
    tensor: torch.Tensor,
    bits: int = 4,
    group_size: int = 64,
    dim: int = -1,
    *,
    out: CompressedTensor | None = None,
    use_triton: bool | None = None,
    chunk_elements: int | None = None,
    meta_dtype: torch.dtype | None = None,
) -> CompressedTensor:
    """Compress ``tensor`` (fp16, bf16 or fp32) in groups of ``group_size`` values along ``dim``.

    The result lives on ``tensor``'s device. With ``out`` (for example a ``narrow`` of a larger
    compressed KV cache), the codes are written into its storage and ``out`` is returned.
    A ``group_size`` that does not divide the dimension is fine: the last group is shorter.
    ``use_triton``: None picks the fused kernel for 4-bit on CUDA where it handles the layout
    (power-of-two groups that divide the dimension, rows in at most three strided runs), True
    insists on it, False uses the torch path. Both give identical bytes. ``meta_dtype``: the dtype of
    the scales and minimums (default: the tensor's); the Triton kernel takes only the tensor's own.
    """
    check_settings(bits, group_size)
    check_dtype(tensor.dtype)
    meta = tensor.dtype if meta_dtype is None else meta_dtype
    check_dtype(meta)
    dim = normalize_dim(dim, tensor.dim())
    out = _quantize_target(tensor, out, bits, group_size, dim, meta)
    moved = tensor.movedim(dim, -1)  # (*rows_shape, D), a view
    if use_triton is None:
        fused = tensor.device.type == "cuda" and bits == 4 and meta == tensor.dtype
        kernels = _load_triton_kernels() if fused else None
        if kernels is not None and _quantize_triton(kernels, moved, out):
            return out
    elif use_triton:
        if meta != tensor.dtype:
            raise CompressionError(f"the Triton quantize kernel stores scales in the tensor's dtype, not {meta}")
        kernels = _require_triton(bits)
        if not _quantize_triton(kernels, moved, out):
            raise CompressionError(f"the Triton quantize kernel does not handle shape {tuple(tensor.shape)} "
                                   f"grouped by {group_size} along dim {dim} with these strides")
        return out
    _quantize_blocks(moved, out, _chunk(chunk_elements, tensor.device))
    return out


def _quantize_target(tensor: torch.Tensor, out: CompressedTensor | None, bits: int, group_size: int, dim: int,
                     meta: torch.dtype) -> CompressedTensor:
    """Where ``quantize`` writes: a new compressed tensor, or ``out`` once its layout and device are
    checked to be the ones asked for."""
    if out is None:
        return CompressedTensor.empty(tensor.shape, meta, bits, group_size, dim, tensor.device)
    layout = (out.shape, out.dtype, out.dim, out.bits, out.group_size)
    if layout != (tensor.shape, meta, dim, bits, group_size):
        raise CompressionError(
            f"out={out!r} does not match a {tensor.dtype} tensor of shape {tuple(tensor.shape)} "
            f"compressed to {bits} bits, group {group_size}, along dim {dim}, with {meta} scales"
        )
    if out.device != tensor.device:
        raise CompressionError(f"out is on {out.device} but the tensor is on {tensor.device}")
    return out


def _quantize_blocks(moved: torch.Tensor, out: CompressedTensor, chunk_elements: int) -> None:
    """The torch path: ``moved`` (the quantized dim last) into ``out``, a block of about
    ``chunk_elements`` values at a time."""
    bits, group_size, meta = out.bits, out.group_size, out.dtype
    for rows, cols in _blocks(out, chunk_elements):
        piece = moved[rows][..., cols.start:cols.stop]
        # reshape copies only this block when the moved view is not contiguous.
        packed, scale, minimum = _quantize_block(piece.reshape(-1, cols.stop - cols.start), bits, group_size, meta)
        bytes_ = _byte_range(cols, bits)
        groups = _group_range(cols, group_size)
        _write(out.data[rows][..., bytes_], packed)
        _write(out.scale[rows][..., groups], scale)
        _write(out.minimum[rows][..., groups], minimum)


@torch.no_grad()
def dequantize(
    ct: CompressedTensor,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """Decompress ``ct`` to a tensor of its original shape, on its device.

    ``dtype`` defaults to the original dtype (or ``out``'s). ``use_triton``: None picks the fused
    Triton kernel for 4-bit tensors on CUDA when Triton is installed, True insists on it, False
    uses the plain torch path. Both give identical results.
    """
    if out is None:
        dtype = ct.dtype if dtype is None else dtype
        check_dtype(dtype)
        out = torch.empty(ct.shape, dtype=dtype, device=ct.device)
    else:
        if tuple(out.shape) != tuple(ct.shape):
            raise CompressionError(f"out has shape {tuple(out.shape)} but the tensor is {tuple(ct.shape)}")
        if dtype is not None and dtype != out.dtype:
            raise CompressionError(f"dtype={dtype} disagrees with out's dtype {out.dtype}")
        check_dtype(out.dtype)
        if out.device != ct.device:
            raise CompressionError(f"out is on {out.device} but the compressed tensor is on {ct.device}")

    kernels = _choose_triton(ct, use_triton)
    if kernels is not None:
        _dequantize_triton(kernels, ct, out)
        return out

    out_moved = out.movedim(ct.dim, -1)  # (*rows_shape, D), a view of out
    scratch = Scratch()
    for rows, cols in _blocks(ct, _dequantize_chunk(chunk_elements, ct.device)):
        bytes_ = _byte_range(cols, ct.bits)
        groups = _group_range(cols, ct.group_size)
        _dequantize_block(
            ct.data[rows][..., bytes_],
            ct.scale[rows][..., groups],
            ct.minimum[rows][..., groups],
            cols.stop - cols.start,
            ct.bits,
            ct.group_size,
            out_moved[rows][..., cols.start:cols.stop],
            scratch,
        )
    return out


def dequantize_chunks(
    ct: CompressedTensor,
    chunk_size: int,
    dim: int,
    dtype: torch.dtype | None = None,
    *,
    use_triton: bool | None = None,
) -> Iterator[torch.Tensor]:
    """Yield ``ct`` decompressed ``chunk_size`` entries at a time along ``dim``.

    ``dim`` must not be the grouped dimension. For a KV cache (batch, kv_heads, seq, head_dim)
    grouped along head_dim, ``dim=0`` walks the batch and ``dim=2`` the sequence; only one chunk
    is ever decompressed at a time. The last chunk may be shorter.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise CompressionError(f"chunk size must be an integer >= 1, got {chunk_size!r}")
    dim = normalize_dim(dim, len(ct.shape))
    if dim == ct.dim:
        raise CompressionError(f"cannot chunk along the grouped dimension {dim}")
    size = ct.shape[dim]
    for start in range(0, size, chunk_size):
        part = ct.narrow(dim, start, min(chunk_size, size - start))
        yield dequantize(part, dtype, use_triton=use_triton)


# ----------------------------------------------------------------------------- blocks of work


def _blocks(ct: CompressedTensor, chunk_elements: int) -> Iterator[tuple[tuple, slice]]:
    """(row selection, column slice) pairs covering ``ct`` in blocks of about ``chunk_elements``.

    Column blocks are whole groups and whole packing units, so each block packs on its own.
    """
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise CompressionError(f"chunk_elements must be an integer >= 1, got {chunk_elements!r}")
    width = ct.group_dim_size
    if width == 0:
        return
    max_rows = max(1, chunk_elements // max(width, 1))
    align = math.lcm(ct.group_size, values_per_unit(ct.bits))
    col_step = width if width <= chunk_elements else max(align, chunk_elements // align * align)
    for rows in _row_selections(tuple(ct.rows_shape), max_rows):
        for start in range(0, width, col_step):
            yield rows, slice(start, min(width, start + col_step))


def _row_selections(rows_shape: tuple[int, ...], max_rows: int, prefix: tuple = ()) -> Iterator[tuple]:
    """Index tuples that select consecutive runs of at most ``max_rows`` rows, in row order.

    Each selection is some leading integers then one slice, so it picks a block that is
    contiguous in a contiguous tensor of shape ``(*rows_shape, last)``.
    """
    if not rows_shape:
        yield prefix
        return
    inner_rows = math.prod(rows_shape[1:])
    if inner_rows <= max_rows:
        step = max(1, max_rows // max(inner_rows, 1))
        for start in range(0, rows_shape[0], step):
            yield prefix + (slice(start, min(rows_shape[0], start + step)),)
    else:
        for index in range(rows_shape[0]):
            yield from _row_selections(rows_shape[1:], max_rows, prefix + (index,))


def _byte_range(cols: slice, bits: int) -> slice:
    per_unit, unit_bytes = values_per_unit(bits), bytes_per_unit(bits)
    start = cols.start // per_unit * unit_bytes  # block starts are unit-aligned
    stop = -(-cols.stop // per_unit) * unit_bytes
    return slice(start, stop)


def _group_range(cols: slice, group_size: int) -> slice:
    return slice(cols.start // group_size, -(-cols.stop // group_size))


def _write(target: torch.Tensor, block: torch.Tensor) -> None:
    """Copy a (rows, n) block into a selection of the same elements with any strides."""
    target.copy_(block.view(target.shape))


# ----------------------------------------------------------------------------- per-block math


def _quantize_block(x: torch.Tensor, bits: int, group_size: int, meta: torch.dtype):
    """(rows, n) -> packed codes (rows, bytes), scale and minimum (rows, ceil(n / group_size)) in ``meta``."""
    rows, width = x.shape
    groups = -(-width // group_size)
    values = x.to(torch.float32)
    short = groups * group_size - width
    if short:
        # Repeat the last real value so the padding cannot move the last group's min or max.
        values = torch.cat((values, values[:, -1:].expand(rows, short)), dim=1)
    grouped = values.view(rows, groups, group_size)
    low = grouped.amin(dim=-1)
    high = grouped.amax(dim=-1)
    levels = (1 << bits) - 1
    # Divide by a device tensor, not a Python number: CUDA turns division by a host scalar into
    # multiplication by its reciprocal, which can differ from the CPU's division in the last bit.
    divisor_levels = torch.full((), float(levels), dtype=torch.float32, device=x.device)
    # Exact in the tensor's own dtype (the minimum is one of its values), so the scale is then
    # (high - low) / levels; in another, at most the group's minimum, so the codes still fit.
    minimum = _round_down_to(low, meta)
    scale = _round_up_to((high - minimum.to(torch.float32)) / divisor_levels, meta)
    scale32 = scale.to(torch.float32)
    divisor = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))
    codes = (grouped - minimum.to(torch.float32).unsqueeze(-1)) / divisor.unsqueeze(-1)
    codes = codes.round_().clamp_(0, levels).to(torch.uint8).view(rows, groups * group_size)
    return pack_codes(codes[:, :width], bits), scale, minimum


def _dequantize_block(packed, scale, minimum, width: int, bits: int, group_size: int, target, scratch) -> None:
    """Decode packed (*rows, bytes) with scale/minimum (*rows, groups) into target (*rows, width)."""
    if packed.device.type == "cpu":
        cpu_kernels.dequantize_block(packed, scale, minimum, width, bits, group_size, target, scratch)
    else:
        _dequantize_block_generic(packed, scale, minimum, width, bits, group_size, target)


def _dequantize_block_generic(packed, scale, minimum, width: int, bits: int, group_size: int, target) -> None:
    """Any device: fp32 temporaries of the whole block. The CPU path gives the same bits faster."""
    packed = packed.reshape(-1, packed.shape[-1])
    scale = scale.reshape(-1, scale.shape[-1])
    minimum = minimum.reshape(-1, minimum.shape[-1])
    rows, groups = scale.shape
    codes = unpack_codes(packed, bits)
    padded = groups * group_size
    if codes.shape[1] >= padded:
        codes = codes[:, :padded]
    else:
        codes = torch.nn.functional.pad(codes, (0, padded - codes.shape[1]))
    values = codes.to(torch.float32).view(rows, groups, group_size)
    # Multiply, then add, as two roundings: the Triton kernel disables fusion to match.
    values = values.mul_(scale.to(torch.float32).unsqueeze(-1)).add_(minimum.to(torch.float32).unsqueeze(-1))
    _write(target, values.view(rows, padded)[:, :width])


def _round_down_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``values`` in ``dtype``, rounded towards -inf (exact where they are representable)."""
    if dtype == torch.float32:
        return values
    rounded = values.to(dtype)
    # A positive value's next representable one down is the previous bit pattern; a negative
    # value rounded down is its magnitude rounded up.
    below = torch.where(values < 0, _round_up_to(-values, dtype).neg(), (rounded.view(torch.int16) - 1).view(dtype))
    return torch.where(rounded.to(torch.float32) > values, below, rounded)


def _round_up_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative fp32 ``values`` in ``dtype``, rounded towards +inf rather than to nearest."""
    if dtype == torch.float32:
        return values
    rounded = values.to(dtype)
    # For non-negative floats, the next representable value up is the next bit pattern.
    bumped = (rounded.view(torch.int16) + 1).view(dtype)
    return torch.where(rounded.to(torch.float32) < values, bumped, rounded)


# ----------------------------------------------------------------------------- Triton dispatch


@functools.cache
def _load_triton_kernels():
    """The Triton kernel module, or None where Triton is not installed."""
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def triton_available() -> bool:
    return _load_triton_kernels() is not None


def _choose_triton(ct: CompressedTensor, use_triton: bool | None):
    if use_triton is False:
        return None
    if use_triton is None:
        if ct.device.type != "cuda" or ct.bits != 4:
            return None
        return _load_triton_kernels()
    return _require_triton(ct.bits)


def _require_triton(bits: int):
    if bits != 4:
        raise CompressionError(f"the Triton kernels handle 4-bit tensors, not {bits}-bit")
    kernels = _load_triton_kernels()
    if kernels is None:
        raise CompressionError("use_triton=True but Triton is not installed")
    return kernels


def _quantize_triton(kernels, moved: torch.Tensor, out: CompressedTensor) -> bool:
    """Quantize ``moved`` (*rows, width) into ``out`` with the fused kernel, in place, whatever the
    row strides; False (and nothing written) where the kernel does not handle the layout."""
    parts = (moved, out.data, out.scale, out.minimum)
    merged = _merge_rows(tuple(moved.shape[:-1]), [part.stride()[:-1] for part in parts])
    if merged is None:
        return False
    sizes, strides = merged
    views = [part.as_strided(sizes + (part.shape[-1],), rows + (part.stride(-1),), part.storage_offset())
             for part, rows in zip(parts, strides)]
    if not kernels.quantize_4bit_supported(*views, out.group_size):
        return False
    kernels.quantize_4bit(*views, out.group_size)
    return True


def _merge_rows(shape: tuple[int, ...], strides: list[tuple[int, ...]]):
    """Fold row dimensions that are one run in every operand: (sizes, per-operand strides), at most
    three dimensions, or None. Dimensions of size 1 drop out."""
    dims = [(size, [s[d] for s in strides]) for d, size in enumerate(shape) if size != 1]
    merged: list[tuple[int, list[int]]] = []
    for size, inner in dims:
        if merged:
            outer_size, outer = merged[-1]
            if all(o == i * size for o, i in zip(outer, inner)):
                merged[-1] = (outer_size * size, inner)
                continue
        merged.append((size, inner))
    if len(merged) > 3:
        return None
    sizes = tuple(size for size, _ in merged)
    return sizes, [tuple(s[k] for _, s in merged) for k in range(len(strides))]


def _dequantize_triton(kernels, ct: CompressedTensor, out: torch.Tensor) -> None:
    rows = math.prod(ct.rows_shape)
    width = ct.group_dim_size
    if rows == 0 or width == 0:
        return
    # The kernel takes 2-D operands; reshape copies only where a narrowed view cannot flatten.
    data = ct.data.reshape(rows, ct.bytes_per_row)
    scale = ct.scale.reshape(rows, ct.num_groups)
    minimum = ct.minimum.reshape(rows, ct.num_groups)
    out_moved = out.movedim(ct.dim, -1)
    try:
        target = out_moved.view(rows, width)
    except RuntimeError:
        target = None
    if target is not None:
        kernels.dequantize_4bit(data, scale, minimum, target, ct.group_size)
        return
    staging = torch.empty((rows, width), dtype=out.dtype, device=out.device)
    kernels.dequantize_4bit(data, scale, minimum, staging, ct.group_size)
    out_moved.copy_(staging.view(out_moved.shape))
