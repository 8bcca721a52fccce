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


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "4-bit"])
@pytest.mark.parametrize("paired", [True, False], ids=["one-allocation", "two-allocations"])
def test_pair_write_stores_what_two_writes_store(compressed, paired):
    """write_pair on (keys, values) halves of one allocation, carved and narrowed alike, stores
    the same bits as two separate writes; on two unrelated buffers it falls back to two writes."""
    fmt = kv_format(CompressionConfig(bits=4, group_size=4) if compressed else None, torch.float32)
    shape = SLOT_MAJOR.shape(SLOTS, ROWS, HEADS, HEAD_DIM)
    allocate = lambda shape, dtype: torch.zeros(shape, dtype=dtype)  # noqa: E731
    pair = fmt.empty_pair(shape, allocate) if paired else (fmt.empty(shape, allocate), fmt.empty(shape, allocate))
    separate = (fmt.empty(shape, allocate), fmt.empty(shape, allocate))
    torch.manual_seed(1)
    k, v = torch.randn(2, 3, HEADS, 2, HEAD_DIM)
    carved = tuple(fmt.carve(buffer, 2, 3) for buffer in pair)
    SLOT_MAJOR.write_pair(fmt, carved, 1, k, v)
    for buffer, x in zip(separate, (k, v)):
        SLOT_MAJOR.write(fmt, fmt.carve(buffer, 2, 3), 1, x)
    for got, want in zip(pair, separate):
        for a, b in zip(fmt.parts(got), fmt.parts(want)):
            assert torch.equal(a, b)
    keys = SLOT_MAJOR.read(fmt, fmt.carve(pair[0], 2, 3), 3)
    assert torch.allclose(keys[:, :, 1:3], k, atol=0.5 if compressed else 0)
