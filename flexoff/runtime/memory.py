"""The capacities of this machine a policy must fit in (see :mod:`flexoff.layout` for what it
needs)."""

from __future__ import annotations

import os
import shutil
import warnings

import psutil
import torch

from ..fileio import usable_offload_dir
from ..layout import Capacity

# Share of the available RAM left unplanned: transient copies while weights load, the allocator's
# slack, and whatever else the machine starts meanwhile.
HOST_HEADROOM = 0.1


def machine_capacity(device: torch.device, gpu_mem: int | None, cpu_mem: int | None,
                     offload_dir: str | None) -> Capacity:
    if gpu_mem is None and device.type == "cuda":
        gpu_mem = torch.cuda.get_device_properties(device).total_memory
    if cpu_mem is None:
        cpu_mem = int(psutil.virtual_memory().available * (1 - HOST_HEADROOM))
    disk = shutil.disk_usage(usable_offload_dir(offload_dir)).free if offload_dir else None
    return Capacity(gpu_mem, cpu_mem, disk, device.type)


def configure_cuda_allocators(device: torch.device) -> str | None:
    """Set CUDA's two caching allocators for an offloading engine, unless the user configured them.

    - The device's maps memory into expandable segments. A plan fills the card (or its cap) to a
      tenth of it. With fixed segments, the large short-lived blocks of a prefill (a batch's MLP
      activations) land beside buffers of other sizes (disk staging, a travelling cache's ring),
      and freed blocks stay reserved in pieces too small for the next large one: under a 16 GiB
      cap 2.9 GiB sat reserved and unused when a 2 GiB block was refused. Expandable segments grow
      by pages, so the reserved memory stays near the allocated.
    - The pinned host allocator (a block's cache slabs) faults its pages in on many threads and
      then registers them, where cudaHostAlloc pins page by page on one: 4 GiB took 0.37 s instead
      of 1.72 s on the H200 machine's 16 cores, and OPT-30B's first block of a 4-bit cache on the
      CPU started 15 s sooner.

    Returns the settings made, or None."""
    if device.type != "cuda" or any(os.environ.get(name) for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        return None
    # torch takes a power of two, at most 128.
    threads = 1 << (min(os.cpu_count() or 1, 128).bit_length() - 1)
    settings = ("expandable_segments:True,pinned_use_cuda_host_register:True,"
                f"pinned_num_register_threads:{threads}")
    with warnings.catch_warnings():  # the setter's name is private and deprecated for a newer one
        warnings.simplefilter("ignore")
        torch.cuda.memory._set_allocator_settings(settings)
    return settings


class DeviceMemoryCap:
    """A CUDA device's caching allocator capped at ``limit`` bytes, emulating a smaller card: it
    refuses anything past the cap. The cap is the whole process's, so its owner lifts it when done
    (else the next model of this process, capped or not, inherits it); lifting twice is fine."""

    def __init__(self, device: torch.device, limit: int):
        total = torch.cuda.get_device_properties(device).total_memory
        # The allocator checks the cap only when it reserves memory anew: blocks this process freed
        # earlier but keeps cached would be handed out past the cap.
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        self.device: torch.device | None = device

    @classmethod
    def for_device(cls, device: torch.device, limit: int | None) -> "DeviceMemoryCap | None":
        """The cap where one is asked for on a CUDA device; None elsewhere (the CPU's "gpu" tier is a
        budget the layout keeps, not an allocator's)."""
        return cls(device, limit) if limit and device.type == "cuda" else None

    def lift(self) -> None:
        if self.device is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.device = None
