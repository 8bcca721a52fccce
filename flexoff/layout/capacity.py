"""Whether a policy's memory fits a machine: the bytes flexoff may use on each tier, and the check
that refuses, before anything large is allocated, a job needing more."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PolicyError
from ..models import ModelConfig
from ..policy import TIERS, Policy
from ..units import format_size
from .block import block_bytes
from .weights import weight_bytes


@dataclass(frozen=True)
class Capacity:
    """Bytes flexoff may use on each tier (None: no limit known).

    ``device`` is the compute device's type. On "cpu" the device tier and the cpu tier are one RAM:
    ``cpu`` is its budget, shared by both (the cpu tier's plan first, the device tier takes what is
    left), and ``gpu`` only a further cap on the device tier (--gpu-mem), or None.
    """

    gpu: int | None
    cpu: int | None
    disk: int | None
    device: str = "cuda"

    @property
    def shared(self) -> bool:
        """The device tier lives in the cpu tier's RAM."""
        return self.device == "cpu"


def tier_name(tier: str, device: torch.device | str) -> str:
    """A tier as it is on this machine: the "gpu" tier is the compute device, the CPU on a machine
    without CUDA."""
    kind = device.type if isinstance(device, torch.device) else str(device)
    return f"device ({kind})" if tier == "gpu" and kind != "cuda" else tier


def job_bytes(cfg: ModelConfig, policy: Policy, dtype: torch.dtype, prompt_len: int, gen_len: int,
              pinned: bool = False, owned: range | None = None, blocks: int = 1, *,
              prefix_len: int = 0, prefix_rows: int = 1) -> dict[str, int]:
    """What a run holds per tier at its peak: the weights and one full block (KV cache, activations,
    workspaces and working memory) of prompts up to ``prompt_len`` tokens generating ``gen_len``;
    of a pipeline stage's range of stages with ``owned``; with ``blocks`` blocks in rotation;
    with shared prefixes of up to ``prefix_len`` tokens at the start of the prompts, ``prefix_rows``
    of them in each GPU batch (one per group of its rows that shares one), each counted once per
    batch (``block.kv_cache_bytes``)."""
    weights = weight_bytes(cfg, policy, dtype, pinned, owned)
    block = block_bytes(cfg, policy, prompt_len, gen_len, dtype.itemsize, pinned, owned, prefix_len=prefix_len,
                        prefix_rows=prefix_rows)
    return {tier: weights[tier] + blocks * block[tier] for tier in TIERS}


def tier_limits(needed: dict[str, int], capacity: Capacity) -> dict[str, int | None]:
    """Bytes each tier may take for ``needed``. With one RAM for the device and the cpu tier, the
    cpu tier's share is planned first and the device tier gets the rest."""
    limits = {tier: getattr(capacity, tier) for tier in TIERS}
    if capacity.shared and capacity.cpu is not None:
        rest = max(0, capacity.cpu - needed["cpu"])
        limits["gpu"] = rest if capacity.gpu is None else min(capacity.gpu, rest)
    return limits


def overflow(needed: dict[str, int], capacity: Capacity) -> str | None:
    """The first tier ``needed`` does not fit (the cpu tier first where it is shared); None if all fit."""
    limits = tier_limits(needed, capacity)
    order = ("cpu", "gpu", "disk") if capacity.shared else TIERS
    return next((t for t in order if limits[t] is not None and needed[t] > limits[t]), None)


def check_fits(needed: dict[str, int], capacity: Capacity, what: str) -> None:
    tier = overflow(needed, capacity)
    if tier is None:
        return
    limit = tier_limits(needed, capacity)[tier]
    name = tier_name(tier, capacity.device)
    where = "is available"
    hint = "move data to another tier or use a smaller batch"
    if capacity.shared and tier in ("gpu", "cpu") and not (tier == "gpu" and limit == capacity.gpu):
        # One RAM: moving data between the device and the cpu tier cannot help, only disk can.
        where = "of RAM is available" + (f" beside the cpu tier's {format_size(needed['cpu'])}"
                                          if tier == "gpu" and needed["cpu"] else "")
        hint = ("the device and the cpu tier share this RAM: put part of the weights or cache on disk "
                "(--percent, whose remainder goes to disk, with --offload-dir DIR), compress them (--compress-weight, "
                "--compress-cache), or use a smaller batch")
    raise PolicyError(
        f"{what} needs {format_size(needed[tier])} on the {name} tier, but only {format_size(limit)} {where} "
        f"(short by {format_size(needed[tier] - limit)}); {hint}"
    )
