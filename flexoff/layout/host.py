"""How the runtime takes host memory, in bytes: whole pages for exactly pinned buffers, slabs for
the rest of pinned memory, and the host worker's fixed share."""

from __future__ import annotations

import torch

PAGE = 4096

# The host worker (see runtime.tiers.HostWorker) keeps at most this many jobs queued; a job keeps its
# GPU inputs (a layer's keys at prefill) alive until it has run.
HOST_JOBS_IN_FLIGHT = 3
# Bytes of each of the host worker's two pinned chunks a strided host write goes through.
HOST_CHUNK = 32 << 20


def pins_host_memory(pin: bool) -> bool:
    """Whether host memory is pinned when a policy asks for it: only where CUDA exists."""
    return pin and torch.cuda.is_available()


class SlabPlan:
    """Where pinned host allocations go: first fit, at ``ALIGN``-byte boundaries, into slabs of
    ``SLAB`` bytes (a larger request gets a power-of-two slab of its own size).

    Pure bookkeeping, so that the memory estimates reserve what the runtime's HostMemory reserves:
    the space a slab's last requests leave unused (a 411 MB matrix does not fit the 201 MB left by
    two others) is host memory all the same, 6-7% of OPT-30B's weights.
    """

    SLAB = 1 << 30
    ALIGN = 512

    def __init__(self):
        self.slabs: list[list[int]] = []  # [size, bytes used]

    def place(self, nbytes: int) -> tuple[int, int]:
        """(slab index, offset) for ``nbytes``; a new slab is added when none has room."""
        need = -(-nbytes // self.ALIGN) * self.ALIGN
        index = next((i for i, (size, used) in enumerate(self.slabs) if size - used >= need), None)
        if index is None:
            self.slabs.append([max(self.SLAB, 1 << max(0, need - 1).bit_length()), 0])
            index = len(self.slabs) - 1
        start = self.slabs[index][1]
        self.slabs[index][1] += need
        return index, start

    @property
    def reserved(self) -> int:
        return sum(size for size, _ in self.slabs)


def slab_bytes(requests) -> int:
    """Host bytes that pinned allocations of ``requests`` bytes, made in this order, reserve."""
    plan = SlabPlan()
    for nbytes in requests:
        plan.place(nbytes)
    return plan.reserved


def registered_bytes(requests) -> int:
    """Host bytes that exactly pinned allocations of ``requests`` bytes take: whole pages each."""
    return sum(pages(nbytes) for nbytes in requests)


def pages(nbytes: int) -> int:
    """Bytes of the whole pages ``nbytes`` take (at least one)."""
    return max(1, -(-nbytes // PAGE)) * PAGE


def disk_file_bytes(nbytes: int) -> int:
    """Bytes of an offload file holding ``nbytes``: whole pages, so large reads map onto them."""
    return -(-nbytes // PAGE) * PAGE
