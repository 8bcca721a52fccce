"""The capacities of this machine a policy must fit in (see :mod:`flexoff.layout` for what it
needs)."""

from __future__ import annotations

import shutil

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

