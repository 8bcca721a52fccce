"""What a policy will hold on each tier, estimated before anything large is allocated, and the
capacities it must fit in."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from ..compression import CompressedTensor
from ..errors import PolicyError
from ..models import ModelConfig, stage_names, stage_specs
from ..units import format_size
from .kv import KVWorkspace
from .kv_storage import SLOT_MAJOR, kv_format
from .placement import place_stage, split_rows
from ..policy import TIERS, Policy
from .tiers import HostWorker, Streams, device_allocator, registered_bytes, slab_bytes
from .weight_store import compressible, dequantize_scratch_numel, stage_kind


# Share of the available RAM left unplanned: transient copies while weights load, the allocator's
# slack, and whatever else the machine starts meanwhile.
HOST_HEADROOM = 0.1


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


def machine_capacity(device: torch.device, gpu_mem: int | None, cpu_mem: int | None,
                     offload_dir: str | None) -> Capacity:
    if gpu_mem is None and device.type == "cuda":
        gpu_mem = torch.cuda.get_device_properties(device).total_memory
    if cpu_mem is None:
        cpu_mem = int(psutil.virtual_memory().available * (1 - HOST_HEADROOM))
    disk = shutil.disk_usage(usable_offload_dir(offload_dir)).free if offload_dir else None
    return Capacity(gpu_mem, cpu_mem, disk, device.type)


def usable_offload_dir(path: str) -> Path:
    """The offload directory, created if needed; refused unless it can be written."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PolicyError(f"cannot use offload directory {path}: {exc.strerror or exc}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PolicyError(f"cannot use offload directory {path}: it is not writable")
    return directory


def weight_bytes(cfg: ModelConfig, policy: Policy, dtype: torch.dtype, pinned: bool = False) -> dict[str, int]:
    """Bytes of weights per tier (compressed where the policy says), plus the GPU buffers that
    streamed stages are assembled and compressed matrices dequantized in. ``pinned``: host memory is
    pinned, so the CPU figure is the whole pages each allocation is registered in (see
    :class:`~.tiers.HostMemory`), disk stages' host staging included."""
    sizes, buffers, requests = _weight_placement_bytes(cfg, policy, dtype)
    sizes["gpu"] += buffers
    sizes["cpu"] = registered_bytes(requests) if pinned else sum(requests)
    return sizes


def weight_host_requests(cfg: ModelConfig, policy: Policy, dtype: torch.dtype) -> list[int]:
    """The weight store's host allocations, in the order it makes them."""
    return _weight_placement_bytes(cfg, policy, dtype)[2]


def weight_buffer_bytes(cfg: ModelConfig, policy: Policy, dtype: torch.dtype) -> int:
    """GPU bytes of the buffers streamed stages are assembled in (a layer's ring of two, and one each
    for the embedding and the head where they stream), and of the scratch compressed matrices are
    dequantized into. A tensor with any rows off the GPU is assembled whole, compressed or not."""
    return _weight_placement_bytes(cfg, policy, dtype)[1]


def _stored_parts(shape: tuple[int, ...], compressed, dtype: torch.dtype) -> list[int]:
    """Bytes of each tensor a stored weight (or piece of one) is allocated as."""
    if compressed is None:
        return [math.prod(shape) * dtype.itemsize]
    meta = CompressedTensor.empty(shape, dtype, compressed.bits, compressed.group_size, -1, device="meta")
    return [t.numel() * t.element_size() for t in (meta.data, meta.scale, meta.minimum)]


def _weight_placement_bytes(cfg: ModelConfig, policy: Policy, dtype: torch.dtype
                            ) -> tuple[dict[str, int], int, list[int]]:
    """(bytes per tier, GPU buffer bytes, host allocations in the order the weight store makes them)."""
    sizes = {tier: 0 for tier in TIERS}
    buffers: dict[str, int] = {}
    staging: dict[str, int] = {}
    requests: list[int] = []
    itemsize = dtype.itemsize
    compression = policy.compress_weight
    for stage in stage_names(cfg):
        placements = place_stage(stage_specs(cfg, stage), policy.weights)
        streamed = disk = 0
        for placement in placements:
            spec = placement.spec
            compressed = compression if compression is not None and compressible(spec) else None
            for piece in placement.pieces:
                shape = (piece.stop - piece.start, *spec.shape[1:])
                parts = _stored_parts(shape, compressed, dtype)
                sizes[piece.tier] += sum(parts)
                if piece.tier == "cpu":
                    requests += parts
                elif piece.tier == "disk":
                    disk += sum(parts)
            if placement.only_tier != "gpu":  # assembled whole, compressed or not
                streamed += sum(_stored_parts(spec.shape, compressed, dtype))
        kind = stage_kind(stage)
        copies = 2 if kind == "layer" and cfg.num_layers > 1 else 1
        buffers[kind] = max(buffers.get(kind, 0), copies * streamed)
        staging[kind] = max(staging.get(kind, 0), disk)
    # Each buffer set has its host staging for disk pieces, made after every stage's pieces.
    for kind, disk in staging.items():
        if disk and buffers[kind]:
            requests += [disk] * (2 if kind == "layer" and cfg.num_layers > 1 else 1)
    scratch = dequantize_scratch_numel(cfg, compression) * itemsize
    return sizes, sum(buffers.values()) + scratch, requests


# The cache's scales and minimums take its dtype; only that dtype's size matters to the estimate.
_DTYPE_OF_SIZE = {2: torch.float16, 4: torch.float32}


def kv_cache_bytes(cfg: ModelConfig, policy: Policy, slots: int, itemsize: int) -> dict[str, int]:
    """One block's KV cache per tier: every batch's storage (compressed bytes where the policy
    compresses the cache), disk rows' host staging, and the GPU workspace the batches share."""
    dtype = _DTYPE_OF_SIZE[itemsize]
    fmt = kv_format(policy.compress_cache, dtype)
    sizes = {tier: 0 for tier in TIERS}
    for piece in split_rows(policy.gpu_batch_size, policy.cache):
        layer_bytes = 2 * fmt.nbytes((slots, piece.stop - piece.start, cfg.num_kv_heads, cfg.head_dim))
        sizes[piece.tier] += cfg.num_layers * layer_bytes * policy.num_gpu_batches
        if piece.tier == "disk":
            sizes["cpu"] += layer_bytes * policy.num_gpu_batches  # each batch stages one layer
    # Built on the meta device, the workspace allocates nothing but knows its size.
    meta = torch.device("meta")
    workspace = KVWorkspace.for_block(cfg, policy, policy.gpu_batch_size, slots, meta, dtype, Streams(meta, False))
    if workspace is not None:
        sizes["gpu"] += workspace.nbytes
    return sizes


def block_host_requests(cfg: ModelConfig, policy: Policy, prompt_len: int, slots: int, itemsize: int) -> list[int]:
    """Host allocations of one block in the order the engine makes them: batch by batch, its cache
    (each tier's rows for every layer, keys then values; one staging pair for disk rows), then its
    offloaded activations."""
    fmt = kv_format(policy.compress_cache, _DTYPE_OF_SIZE[itemsize])
    meta = device_allocator("meta")
    cache: list[int] = []
    for piece in split_rows(policy.gpu_batch_size, policy.cache):
        if piece.tier == "gpu":
            continue
        shape = SLOT_MAJOR.shape(slots, piece.stop - piece.start, cfg.num_kv_heads, cfg.head_dim)
        pair = [t.numel() * t.element_size() for t in fmt.parts(fmt.empty(shape, meta))] * 2
        cache += pair * (cfg.num_layers if piece.tier == "cpu" else 1)
    activations = [(p.stop - p.start) * prompt_len * cfg.hidden_size * itemsize
                   for p in split_rows(policy.gpu_batch_size, policy.activations) if p.tier != "gpu"]
    return (cache + activations) * policy.num_gpu_batches


def block_bytes(cfg: ModelConfig, policy: Policy, prompt_len: int, gen_len: int, itemsize: int,
                pinned: bool = False) -> dict[str, int]:
    """KV cache, activations and working memory of one full block, per tier. ``pinned``: host
    memory is pinned, so its figure is the slabs the block's allocations take."""
    sizes = kv_cache_bytes(cfg, policy, prompt_len + gen_len, itemsize)
    rows = policy.gpu_batch_size
    hidden_per_row = prompt_len * cfg.hidden_size * itemsize
    for piece in split_rows(rows, policy.activations):
        tier = "cpu" if piece.tier == "disk" else piece.tier  # disk rows are staged through host memory
        sizes[tier] += (piece.stop - piece.start) * hidden_per_row * policy.num_gpu_batches
        if piece.tier == "disk":
            sizes["disk"] += (piece.stop - piece.start) * hidden_per_row * policy.num_gpu_batches
    if pinned:
        sizes["cpu"] = slab_bytes(block_host_requests(cfg, policy, prompt_len, prompt_len + gen_len, itemsize))
    # Working memory of the largest step, one batch at a time: the prefill's MLP intermediate,
    # q/k/v, and fp32 logits of the last position.
    working = rows * prompt_len * (cfg.intermediate_size + 4 * cfg.hidden_size) * itemsize
    working += rows * cfg.vocab_size * 4 * 2
    sizes["gpu"] += working
    # The host worker's queued prefill jobs each keep one batch's new keys and values of the rows
    # they store in host memory on the GPU until copied, through two pinned chunks.
    off_gpu = sum(p.stop - p.start for p in split_rows(rows, policy.cache) if p.tier != "gpu")
    if off_gpu:
        per_job = 2 * off_gpu * prompt_len * cfg.num_kv_heads * cfg.head_dim * itemsize
        sizes["gpu"] += HostWorker.MAX_IN_FLIGHT * per_job
        sizes["cpu"] += 2 * HostWorker.CHUNK
    return sizes


def job_bytes(cfg: ModelConfig, policy: Policy, dtype: torch.dtype, prompt_len: int, gen_len: int,
              pinned: bool = False) -> dict[str, int]:
    """What a run holds per tier at its peak: the weights and one full block (KV cache, activations,
    workspaces and working memory) of prompts up to ``prompt_len`` tokens generating ``gen_len``."""
    weights = weight_bytes(cfg, policy, dtype, pinned)
    block = block_bytes(cfg, policy, prompt_len, gen_len, dtype.itemsize, pinned)
    return {tier: weights[tier] + block[tier] for tier in TIERS}


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
