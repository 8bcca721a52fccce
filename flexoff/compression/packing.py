"""Bit packing of quantization codes, row by row.

Each row of codes (one row = all values along the grouped dimension) is packed on its own, so a
slice of rows is a slice of the packed bytes. Layouts, little-endian within a byte or word:

- 8 bits: one code per byte.
- 4 bits: two codes per byte; the even-indexed code sits in the low nibble.
- 2 bits: four codes per byte; code ``i`` of a byte sits at bits ``2i .. 2i+1``.
- 3 bits: eight codes per 3-byte unit; code ``i`` sits at bits ``3i .. 3i+2`` of the 24-bit
  little-endian word, so no bit is wasted.

A row is padded with zero codes up to a whole packing unit; those codes are never read back.
"""

from __future__ import annotations

import torch


def values_per_unit(bits: int) -> int:
    """Codes in one packing unit (the smallest run of whole bytes)."""
    return 8 if bits == 3 else 8 // bits


def bytes_per_unit(bits: int) -> int:
    return 3 if bits == 3 else 1


def packed_row_bytes(num_values: int, bits: int) -> int:
    """Bytes that one row of ``num_values`` codes occupies once packed."""
    units = -(-num_values // values_per_unit(bits))
    return units * bytes_per_unit(bits)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (rows, n) uint8, each < 2**bits, into (rows, packed_row_bytes(n, bits)) uint8."""
    rows, num_values = codes.shape
    per_unit = values_per_unit(bits)
    short = -num_values % per_unit
    if short:
        codes = torch.nn.functional.pad(codes, (0, short))
    if bits == 8:
        return codes.contiguous()
    units = codes.reshape(rows, -1, per_unit)
    if bits == 3:
        # Build the 24-bit word in int32, then split it into its three bytes.
        word = units[..., 0].to(torch.int32)
        for i in range(1, per_unit):
            word |= units[..., i].to(torch.int32) << (3 * i)
        packed = torch.stack((word & 0xFF, (word >> 8) & 0xFF, word >> 16), dim=-1)
        return packed.to(torch.uint8).reshape(rows, -1)
    packed = units[..., 0].clone()
    for i in range(1, per_unit):
        packed |= units[..., i] << (bits * i)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: (rows, bytes) uint8 -> (rows, whole units of codes) uint8.

    The result may be longer than the row that was packed (the unit padding); callers slice it.
    """
    rows = packed.shape[0]
    if bits == 8:
        return packed
    per_unit = values_per_unit(bits)
    if bits == 3:
        triples = packed.reshape(rows, -1, 3).to(torch.int32)
        word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
        shifts = torch.arange(0, 3 * per_unit, 3, dtype=torch.int32, device=packed.device)
        return ((word.unsqueeze(-1) >> shifts) & 0x7).to(torch.uint8).reshape(rows, -1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.unsqueeze(-1) >> shifts) & mask).reshape(rows, -1)
