"""A GGUF tensor's bytes as torch values, and its 4- and 8-bit blocks as flexoff's compressed parts.

ggml's blocks of 32 values along a row (the last torch dimension), each led by an fp16 scale ``d``:

- Q8_0: ``d``, 32 int8 ``q``; ``x = d * q``.
- Q4_0: ``d``, 16 bytes; byte ``j`` holds value ``j`` (low nibble) and ``j + 16`` (high); ``x = d * (q - 8)``.
- Q4_1: ``d``, an fp16 minimum ``m``, 16 bytes as Q4_0's; ``x = d * q + m``.

The values are computed as gguf's ``dequantize`` computes them (fp32 products and sums), so they
agree bit for bit. Other block types are decoded by that package where it is installed.

flexoff's codec stores ``x = code * scale + minimum`` with unsigned codes: Q4_1 is that format
already, Q4_0 is it with ``minimum = -8 * d``, Q8_0 with codes ``q + 128`` and ``minimum = -128 * d``.
Each product of a code with an fp16 scale fits fp32's significand, so the codec's fp32 decoding
gives the same bits as the formulas above.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

NATIVE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# Stored type -> (bits, offset of the unsigned codes: minimum = -offset * d).
AS_COMPRESSED = {"Q4_0": (4, 8), "Q4_1": (4, None), "Q8_0": (8, 128)}
BLOCK = 32
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def gguf_package():
    """The gguf package's quants module, or None where it is not installed."""
    try:
        from gguf import quants
    except ImportError:
        return None
    return quants


def _torch(rows: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # the map is read-only, and only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(rows)


def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 stored at byte ``at`` of each block, as fp32 (one column)."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(quads: torch.Tensor) -> torch.Tensor:
    """16 bytes of a block as its 32 4-bit codes in value order."""
    return torch.cat((quads & 0x0F, quads >> 4), dim=1)


def decode_rows(rows: np.ndarray, type_name: str, type_id: int, cols: int) -> torch.Tensor:
    """(rows, bytes per row) uint8 of one tensor -> (rows, cols) values: a floating type in its own
    dtype, a block type in fp32."""
    count = rows.shape[0]
    if type_name in _FLOATS:
        return _torch(rows).view(_FLOATS[type_name]).reshape(count, cols)
    if type_name not in _BLOCK_BYTES:
        quants = gguf_package()
        from gguf.constants import GGMLQuantizationType

        return _torch(np.ascontiguousarray(quants.dequantize(rows, GGMLQuantizationType(type_id)))).reshape(count, cols)
    blocks = _torch(rows).reshape(-1, _BLOCK_BYTES[type_name])
    d = _scale(blocks, 0)
    if type_name == "Q8_0":
        values = blocks[:, 2:].contiguous().view(torch.int8).float() * d
    elif type_name == "Q4_0":
        values = d * (_nibbles(blocks[:, 2:]).float() - 8)
    else:
        values = d * _nibbles(blocks[:, 4:]).float() + _scale(blocks, 2)
    return values.reshape(count, cols)


def compressed_rows(rows: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, bytes per row) uint8 of a Q4_0, Q4_1 or Q8_0 tensor -> flexoff's packed codes (rows,
    bytes) uint8, and fp32 scales and minimums (rows, groups), one group per block."""
    count = rows.shape[0]
    blocks = _torch(rows).reshape(-1, _BLOCK_BYTES[type_name])
    d = _scale(blocks, 0)
    bits, offset = AS_COMPRESSED[type_name]
    if bits == 8:
        data = (blocks[:, 2:] ^ 0x80).reshape(count, -1)  # int8 q as unsigned q + 128
    else:
        codes = _nibbles(blocks[:, 4:] if offset is None else blocks[:, 2:]).reshape(count, -1, 2)
        data = codes[..., 0] | (codes[..., 1] << 4)  # flexoff's packing: the even code in the low nibble
    minimum = _scale(blocks, 2) if offset is None else d * -float(offset)
    return data.reshape(count, -1), d.reshape(count, -1), minimum.reshape(count, -1)
