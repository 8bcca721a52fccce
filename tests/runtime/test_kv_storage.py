"""The workspace's runs per tier: rows carved out of a slot-major buffer are contiguous and disjoint."""

import pytest
import torch

from flexoff.policy import CompressionConfig
from flexoff.runtime.kv_storage import SLOT_MAJOR, kv_format

SLOTS, ROWS, HEADS, HEAD_DIM = 5, 7, 2, 8


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "4-bit"])
def test_carved_rows_are_contiguous_disjoint_and_round_trip(compressed):
    fmt = kv_format(CompressionConfig(bits=4, group_size=4) if compressed else None, torch.float32)
    buffer = fmt.empty(SLOT_MAJOR.shape(SLOTS, ROWS, HEADS, HEAD_DIM), lambda shape, dtype: torch.empty(shape, dtype=dtype))
    for part in fmt.parts(buffer):
        part.zero_()
    pieces = [(0, 3), (3, 1), (4, 3)]
    torch.manual_seed(0)
    written = []
    for offset, count in pieces:
        run = fmt.carve(buffer, offset, count)
        assert tuple(run.shape) == (SLOTS, count, HEADS, HEAD_DIM)
        assert all(part.is_contiguous() for part in fmt.parts(run.narrow(0, 0, 3)))
        x = torch.randn(count, HEADS, 3, HEAD_DIM)
        SLOT_MAJOR.write(fmt, run, 0, x)
        written.append(x)
    # Each run still reads what was written to it: none overwrote another's storage.
    for (offset, count), x in zip(pieces, written):
        got = SLOT_MAJOR.read(fmt, fmt.carve(buffer, offset, count), 3)
        tolerance = 0.5 if compressed else 0
        assert torch.allclose(got, x, atol=tolerance), (offset, count)
    # Together the runs cover the buffer's first slots' storage exactly once.
    used = sum(p.numel() for offset, count in pieces for p in fmt.parts(fmt.carve(buffer, offset, count)))
    assert used == sum(p.numel() for p in fmt.parts(buffer))
