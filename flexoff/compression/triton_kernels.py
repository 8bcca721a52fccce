"""Fused Triton kernels for 4-bit codes (CUDA): dequantize, and quantize whole power-of-two groups.

Each is one pass over memory where the torch path makes several fp32 temporaries per block of
work: dequantize reads the packed bytes with the group scales and minimums and writes the output
dtype; quantize reads the values once and writes codes, scales and minimums. Both compute exactly
what the torch path computes (IEEE division, round half to even, no fused multiply-add), so the
bytes and values agree bit for bit. Importing this module needs Triton;
:mod:`flexoff.compression.codec` imports it only when it is about to use it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Values each program writes: enough to hide memory latency, small enough for many programs.
_TILE_VALUES = 4096


# Triton compiles a kernel anew for every pattern of its integer arguments (equal to 1, divisible
# by 16, neither): one OPT-30B job left 15 entries in its cache and spent 12.8 s compiling on a fresh
# machine. Counts only bound the masks and the grid, so they are compiled generic;
# widths and strides stay specialised, where divisibility lets loads and stores vectorise.
@triton.jit(do_not_specialize=["rows", "num_groups", "num_col_blocks"])
def _dequantize_4bit_kernel(
    data_ptr,
    scale_ptr,
    minimum_ptr,
    out_ptr,
    rows,
    width,
    row_bytes,
    num_groups,
    data_row_stride,
    meta_row_stride,
    out_row_stride,
    out_col_stride,
    num_col_blocks,
    GROUP_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
    WHOLE_GROUPS: tl.constexpr,
):
    # long: a Triton kernel is one compiled program whose steps share the block's offsets and masks,
    # and it runs only on a GPU, so a split could not be tested on the CPU.
    # A 1-D grid avoids the 65535 limit on the second grid axis for very long rows.
    program = tl.program_id(0)
    row_block = program // num_col_blocks
    col_block = program % num_col_blocks
    BLOCK_VALUES: tl.constexpr = 2 * BLOCK_BYTES

    row = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_ok = row < rows
    byte = col_block * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    # row_bytes is its own argument (not derived from width) so Triton can see its divisibility
    # and vectorise these loads.
    packed = tl.load(
        data_ptr + row[:, None] * data_row_stride + byte[None, :],
        mask=row_ok[:, None] & (byte[None, :] < row_bytes),
        other=0,
    )
    # Value 2j is the low nibble of byte j and value 2j+1 the high nibble.
    codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)

    col = (col_block * BLOCK_VALUES + tl.arange(0, BLOCK_VALUES)).to(tl.int64)
    mask = row_ok[:, None] & (col[None, :] < width)
    if WHOLE_GROUPS:
        # A tile holds whole groups: load each group's scale and minimum once and broadcast.
        GROUPS: tl.constexpr = BLOCK_VALUES // GROUP_SIZE
        group = col_block * GROUPS + tl.arange(0, GROUPS)
        meta_offset = row[:, None] * meta_row_stride + group[None, :]
        meta_mask = row_ok[:, None] & (group[None, :] < num_groups)
        scale = tl.load(scale_ptr + meta_offset, mask=meta_mask, other=0.0).to(tl.float32)
        minimum = tl.load(minimum_ptr + meta_offset, mask=meta_mask, other=0.0).to(tl.float32)
        grouped = tl.reshape(codes, (BLOCK_ROWS, GROUPS, GROUP_SIZE))
        values = grouped * scale[:, :, None] + minimum[:, :, None]
        values = tl.reshape(values, (BLOCK_ROWS, BLOCK_VALUES))
    else:
        meta_offset = row[:, None] * meta_row_stride + (col // GROUP_SIZE)[None, :]
        scale = tl.load(scale_ptr + meta_offset, mask=mask, other=0.0).to(tl.float32)
        minimum = tl.load(minimum_ptr + meta_offset, mask=mask, other=0.0).to(tl.float32)
        values = codes * scale + minimum
    tl.store(
        out_ptr + row[:, None] * out_row_stride + col[None, :] * out_col_stride,
        values.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=mask,
    )


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dequantize_4bit(
    data: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    out: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """Decode packed 4-bit rows into ``out``.

    data: (rows, ceil(width / 2)) uint8; scale, minimum: (rows, ceil(width / group_size));
    out: (rows, width) of fp16, bf16 or fp32, any strides (a transposed view is fine).
    The last dimension of data, scale and minimum must be contiguous.
    """
    rows, width = out.shape
    if rows == 0 or width == 0:
        return out
    for name, part in (("data", data), ("scale", scale), ("minimum", minimum)):
        if part.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension")
    if scale.stride(0) != minimum.stride(0):
        raise ValueError("scale and minimum must share their row stride")
    row_bytes = (width + 1) // 2
    if out.stride(1) == 1 or out.stride(0) != 1:
        # Rows are contiguous in the output: make the tile wide so stores coalesce along a row.
        block_bytes = min(128, _next_power_of_2(row_bytes))
        block_rows = max(1, _TILE_VALUES // (2 * block_bytes))
    else:
        # A transposed output (grouped along dim 0): consecutive rows are adjacent in memory, so
        # the tile is tall, yet at least one group wide so scales can be broadcast.
        block_bytes = min(max(16, min(group_size // 2, 64)), _next_power_of_2(row_bytes))
        block_rows = max(1, _TILE_VALUES // (2 * block_bytes))
    num_col_blocks = triton.cdiv(row_bytes, block_bytes)
    grid = (triton.cdiv(rows, block_rows) * num_col_blocks,)
    block_values = 2 * block_bytes
    # Broadcasting per group needs power-of-two groups that tile the block exactly.
    whole_groups = group_size & (group_size - 1) == 0 and block_values % group_size == 0
    _dequantize_4bit_kernel[grid](
        data,
        scale,
        minimum,
        out,
        rows,
        width,
        row_bytes,
        scale.shape[1],
        data.stride(0),
        scale.stride(0),
        out.stride(0),
        out.stride(1),
        num_col_blocks,
        GROUP_SIZE=group_size,
        BLOCK_ROWS=block_rows,
        BLOCK_BYTES=block_bytes,
        WHOLE_GROUPS=whole_groups,
        num_warps=4,
        # Separate multiply and add roundings, exactly as the torch path computes them.
        enable_fp_fusion=False,
    )
    return out


# Round half to even for 0 <= x < 2**22: adding 1.5 * 2**23 leaves no fraction bits, so the IEEE
# addition itself rounds, to nearest even, as torch.round does.
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit(do_not_specialize=["rows", "size1", "size2", "num_col_blocks"])  # see the dequantize kernel
def _quantize_4bit_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    minimum_ptr,
    rows,
    size1,
    size2,
    x_stride0,
    x_stride1,
    x_stride2,
    data_stride0,
    data_stride1,
    data_stride2,
    meta_stride0,
    meta_stride1,
    meta_stride2,
    width,
    num_col_blocks,
    GROUP_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_VALUES: tl.constexpr,
    ROUND_SCALE: tl.constexpr,
):
    # long: a Triton kernel is one compiled program whose steps share the block's offsets and masks,
    # and it runs only on a GPU, so a split could not be tested on the CPU.
    program = tl.program_id(0)
    row_block = program // num_col_blocks
    col_block = program % num_col_blocks
    GROUPS: tl.constexpr = BLOCK_VALUES // GROUP_SIZE
    BLOCK_BYTES: tl.constexpr = BLOCK_VALUES // 2

    # Rows are indexed by up to three dimensions, each with its own stride in every operand, so
    # a permuted view (a layer's keys in the cache's slot-major order) is read in place.
    row = (row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_ok = row < rows
    i2 = row % size2
    i1 = (row // size2) % size1
    i0 = row // size2 // size1
    x_row = i0 * x_stride0 + i1 * x_stride1 + i2 * x_stride2
    data_row = i0 * data_stride0 + i1 * data_stride1 + i2 * data_stride2
    meta_row = i0 * meta_stride0 + i1 * meta_stride1 + i2 * meta_stride2

    col = (col_block * BLOCK_VALUES + tl.arange(0, BLOCK_VALUES)).to(tl.int64)
    # width is a multiple of GROUP_SIZE, so a group is either wholly inside or wholly masked.
    mask = row_ok[:, None] & (col[None, :] < width)
    x = tl.load(x_ptr + x_row[:, None] + col[None, :], mask=mask, other=0.0).to(tl.float32)
    grouped = tl.reshape(x, (BLOCK_ROWS, GROUPS, GROUP_SIZE))
    low = tl.min(grouped, axis=2)
    high = tl.max(grouped, axis=2)
    raw_scale = tl.div_rn(high - low, 15.0)
    store_type = scale_ptr.dtype.element_ty
    if ROUND_SCALE:
        # Round the scale up to the 16-bit dtype: for non-negative floats the next value up is the
        # next bit pattern.
        rounded = raw_scale.to(store_type, fp_downcast_rounding="rtne")
        bumped = (rounded.to(tl.int16, bitcast=True) + 1).to(store_type, bitcast=True)
        scale = tl.where(rounded.to(tl.float32) < raw_scale, bumped, rounded)
    else:
        scale = raw_scale.to(store_type)
    minimum = low.to(store_type)  # exact: the minimum is one of the values
    scale32 = scale.to(tl.float32)
    divisor = tl.where(scale32 > 0, scale32, 1.0)
    codes = tl.div_rn(grouped - minimum.to(tl.float32)[:, :, None], divisor[:, :, None])
    codes = (codes + _ROUND_MAGIC) - _ROUND_MAGIC
    codes = tl.minimum(tl.maximum(codes, 0.0), 15.0).to(tl.uint8)
    # Value 2j is the low nibble of byte j and value 2j+1 the high nibble.
    low_nibble, high_nibble = tl.split(tl.reshape(codes, (BLOCK_ROWS, BLOCK_BYTES, 2)))
    packed = low_nibble | (high_nibble << 4)

    byte = col_block * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    tl.store(data_ptr + data_row[:, None] + byte[None, :], packed,
             mask=row_ok[:, None] & (byte[None, :] < width // 2))
    group = col_block * GROUPS + tl.arange(0, GROUPS)
    meta_offset = meta_row[:, None] + group[None, :]
    meta_mask = row_ok[:, None] & (group[None, :] < width // GROUP_SIZE)
    tl.store(scale_ptr + meta_offset, scale, mask=meta_mask)
    tl.store(minimum_ptr + meta_offset, minimum, mask=meta_mask)


_QUANT_MAX_VALUES = 1024  # values per row in one tile; wider rows take several column blocks
_QUANT_TILE_VALUES = 2048


def quantize_4bit_supported(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                            group_size: int) -> bool:
    """Whether :func:`quantize_4bit` handles these operands (otherwise use the torch path): whole
    power-of-two groups of at most 1024 values, at most three row dimensions, every operand
    contiguous along its last dimension, and scale and minimum with the same row strides."""
    width = x.shape[-1]
    return (group_size >= 2 and group_size & (group_size - 1) == 0 and group_size <= _QUANT_MAX_VALUES
            and width > 0 and width % group_size == 0 and x.dim() - 1 <= 3
            and all(part.stride(-1) == 1 or part.shape[-1] == 1 for part in (x, data, scale, minimum))
            and scale.stride()[:-1] == minimum.stride()[:-1])


def quantize_4bit(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                  group_size: int) -> None:
    """Encode x (*rows, width) into data (*rows, width / 2), scale and minimum (*rows, groups).

    Up to three row dimensions with any strides; see :func:`quantize_4bit_supported` for the
    layouts handled.
    """
    rows_shape = tuple(x.shape[:-1])
    width = x.shape[-1]
    if not quantize_4bit_supported(x, data, scale, minimum, group_size):
        raise ValueError(f"layout not handled: x {tuple(x.shape)} with strides {x.stride()}, group {group_size}")
    rows = math.prod(rows_shape)
    if rows == 0:
        return
    pad = 3 - len(rows_shape)
    sizes = (1,) * pad + rows_shape
    x_strides, data_strides, meta_strides = (
        (0,) * pad + tuple(part.stride()[:-1]) for part in (x, data, scale)
    )
    block_values = min(_QUANT_MAX_VALUES, _next_power_of_2(width))
    block_rows = max(1, _QUANT_TILE_VALUES // block_values)
    num_col_blocks = triton.cdiv(width, block_values)
    grid = (triton.cdiv(rows, block_rows) * num_col_blocks,)
    _quantize_4bit_kernel[grid](
        x, data, scale, minimum,
        rows, sizes[1], sizes[2],
        *x_strides, *data_strides, *meta_strides,
        width, num_col_blocks,
        GROUP_SIZE=group_size,
        BLOCK_ROWS=block_rows,
        BLOCK_VALUES=block_values,
        ROUND_SCALE=scale.dtype != torch.float32,
        num_warps=4,
        enable_fp_fusion=False,
    )
