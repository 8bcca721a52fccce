"""Dequantization of one block on the CPU, with plain torch ops that each run as one vectorised pass.

The generic path (still used on CUDA without Triton) was slow on the CPU for three reasons:
unpacking with a shift broadcast over a last dimension of 2 to 8 runs torch's small-inner-loop
path (~3 G values/s); converting fp32 into a transposed fp16 output is a scalar loop per element;
and pad/slice/cast steps each made another temporary. Here:

- Codes are unpacked by *spreading* each packing unit into a wider integer whose little-endian
  bytes are that unit's codes (4-bit: ``(w | w << 4) & 0x0F0F`` in int16), so the codes come
  out interleaved in order with a few contiguous integer ops, no gather and no strided write.
- The codes are widened to fp32 in a reused scratch buffer, multiplied by the scale, the minimum
  added (separate roundings, exactly the generic and Triton formula, so results are
  bit-identical), and converted once into the output.
- Where the output is transposed (grouped along a leading dim of a row-major tensor), the packed
  bytes, the smallest form of the block, are transposed with torch's blocked transpose and the
  block is decoded in the output's layout, so every later op is contiguous too.

Blocks are the codec's ``chunk_elements`` (by default 2M values, 256K per thread beyond 8
threads): smaller blocks pay per-op and per-thread overhead, larger ones fall out of cache.
"""

from __future__ import annotations

import math
import sys

import torch

from .packing import bytes_per_unit, unpack_codes, values_per_unit

# bits -> (integer dtype one packing unit widens to, stages). Each stage ``(shift, mask)`` splits
# every lane of the integer in two: ``x = (x | x << shift) & mask`` moves a lane's upper half up
# into the next lane; after the last stage each byte holds one code.
_SPREAD = {
    4: (torch.int16, ((4, 0x0F0F),)),
    2: (torch.int32, ((12, 0x000F000F), (6, 0x03030303))),
    3: (torch.int64, ((20, 0x00000FFF00000FFF), (10, 0x003F003F003F003F), (5, 0x0707070707070707))),
}
# The spread reads codes out of an integer's bytes in memory order.
_LITTLE_ENDIAN = sys.byteorder == "little"


class Scratch:
    """Flat buffers reused by the blocks of one dequantize call (no allocation per block)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(shape)


def dequantize_block(packed, scale, minimum, width: int, bits: int, group_size: int, target,
                     scratch: Scratch) -> None:
    """Decode a block into ``target``.

    packed (*rows, bytes) uint8, scale and minimum (*rows, groups), target (*rows, width) of fp16,
    bf16 or fp32; any strides, except that each last dimension of the inputs is contiguous.
    """
    rows = math.prod(packed.shape[:-1])
    if rows == 0:
        return
    try:
        target2d = target.view(rows, width)
    except RuntimeError:
        target2d = None
    if target2d is not None and rows > 1 and target2d.stride(0) == 1 and width > 1:
        _columns(packed.reshape(rows, -1), scale.reshape(rows, -1), minimum.reshape(rows, -1), width, bits,
                 group_size, target2d, scratch)
    else:
        _rows(packed, scale, minimum, rows, width, bits, group_size, target, target2d, scratch)


def _rows(packed, scale, minimum, rows, width, bits, group_size, target, target2d, scratch) -> None:
    """Decode with rows kept as rows: the output's last dimension is contiguous (or stride-free)."""
    groups = scale.shape[-1]
    padded = groups * group_size
    codes = _unpack_rows(packed, rows, bits, scratch)  # (rows, whole units of codes)
    direct = (target2d is not None and target2d.dtype == torch.float32 and target2d.is_contiguous()
              and width == padded)
    # An fp32 output is its own scratch; otherwise fp32 values are converted in one final pass.
    values = target2d if direct else scratch.get("values", (rows, padded), torch.float32)
    length = codes.shape[1]
    if length >= padded:
        values.copy_(codes[:, :padded])  # the unit padding past the groups is never read
    else:
        values[:, :length].copy_(codes)
        values[:, length:].zero_()  # a short last group; uninitialised memory could hold slow denormals
    grouped = values.view(rows, groups, group_size)
    grouped.mul_(scale.reshape(rows, groups, 1).to(torch.float32))
    grouped.add_(minimum.reshape(rows, groups, 1).to(torch.float32))
    if direct:
        return
    if target2d is not None:
        target2d.copy_(values[:, :width])
    else:
        target.copy_(values[:, :width].view(target.shape))


def _unpack_rows(packed, rows: int, bits: int, scratch: Scratch) -> torch.Tensor:
    """Packed (*rows, bytes) -> codes (rows, units * values_per_unit) uint8."""
    if bits == 8:
        return packed.reshape(rows, -1)
    if bits not in _SPREAD or not _LITTLE_ENDIAN:
        return unpack_codes(packed.reshape(rows, -1), bits)
    wide_dtype, stages = _SPREAD[bits]
    units = packed.shape[-1] // bytes_per_unit(bits)
    wide = scratch.get("wide", (rows, units), wide_dtype)
    if bits == 3:
        # The unit's 3 bytes become the low bytes of an int64; the high bytes must be zero.
        as_bytes = wide.view(torch.uint8).view(packed.shape[:-1] + (units, 8))
        as_bytes[..., :3].copy_(packed.unflatten(-1, (units, 3)))
        as_bytes[..., 3:].zero_()
    else:
        wide.view(packed.shape[:-1] + (units,)).copy_(packed)  # widen; reads any row strides
    shifted = scratch.get("shifted", (rows, units), wide_dtype)
    for shift, mask in stages:
        torch.bitwise_left_shift(wide, shift, out=shifted)
        wide.bitwise_or_(shifted).bitwise_and_(mask)
    return wide.view(torch.uint8).view(rows, units * values_per_unit(bits))


def _columns(packed, scale, minimum, width, bits, group_size, target2d, scratch) -> None:
    """Decode in the output's layout, (width, rows), for an output whose rows are adjacent."""
    rows, row_bytes = packed.shape
    groups = scale.shape[1]
    padded = groups * group_size
    per_unit, unit_bytes = values_per_unit(bits), bytes_per_unit(bits)
    units = row_bytes // unit_bytes
    length = units * per_unit
    # torch's blocked transpose (a contiguous copy of a transposed 2-D view of the same dtype).
    flipped = scratch.get("flipped", (row_bytes, rows), torch.uint8)
    flipped.copy_(packed.t())
    # Rows past the codes' (length) belong to a short last group; those past the groups (padded)
    # hold the unit padding. Both are cut off at the end.
    values = scratch.get("values", (max(length, padded), rows), torch.float32)
    if bits == 8:
        values[:length].copy_(flipped)
    else:
        if bits == 3:
            triples = flipped.view(units, 3, rows).to(torch.int32)
            unit = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        else:
            unit = flipped
        # Code i of every unit goes to every per_unit-th row, each a contiguous row of the output.
        by_code = values[:length].view(units, per_unit, rows)
        for i in range(per_unit):
            by_code[:, i].copy_((unit >> (bits * i)) & ((1 << bits) - 1))
    values[length:padded].zero_()  # uninitialised memory could hold slow denormals
    grouped = values[:padded].view(groups, group_size, rows)
    grouped.mul_(_transposed_meta(scale, "scale", scratch).unsqueeze(1))
    grouped.add_(_transposed_meta(minimum, "minimum", scratch).unsqueeze(1))
    target2d.t().copy_(values[:width])


def _transposed_meta(meta, name: str, scratch: Scratch) -> torch.Tensor:
    flipped = scratch.get(name, (meta.shape[1], meta.shape[0]), torch.float32)
    flipped.copy_(meta.t())
    return flipped

