"""Fused Triton dequantize kernel for 4-bit codes (CUDA).

One pass reads the packed bytes and the group scales and minimums and writes the output dtype
directly, where the torch path makes several fp32 temporaries. Importing this module needs
Triton; :mod:`flexoff.compression.codec` imports it only when it is about to use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Values each program writes: enough to hide memory latency, small enough for many programs.
_TILE_VALUES = 4096


@triton.jit
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
