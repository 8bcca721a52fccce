"""The weights of a policy, in bytes: each stage's pieces per tier at their stored size, the GPU
buffers streamed stages are assembled in, the dequantization scratch, and the host allocations in
the order the runtime's weight store makes them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..compression.packing import packed_row_bytes
from ..models import ModelConfig, Stage, WeightSpec, stage_specs, stages
from ..policy import TIERS, CompressionConfig, Policy
from .host import disk_file_bytes, registered_bytes
from .placement import TensorPlacement, place_layer


def compressible(spec: WeightSpec) -> bool:
    """Matrices (and a layer's experts' matrices, stacked) are compressed, but for those the model
    keeps exact (a router); norms and biases are too small to matter."""
    return len(spec.shape) >= 2 and spec.quantizable


def owned_stages(cfg: ModelConfig, owned: range | None = None) -> list[Stage]:
    """The model's stages a device runs: all of them, or a pipeline stage's range of their indices
    (0 the embedding, then the decoder layers, then the head)."""
    every = stages(cfg)
    return every if owned is None else every[owned.start:owned.stop]


def owned_layers(cfg: ModelConfig, owned: range | None = None) -> list[int]:
    """The decoder layers a device runs (and holds the caches of): all, or a pipeline stage's."""
    return [stage.index for stage in owned_stages(cfg, owned) if stage.kind == "layer"]


def buffer_copies(cfg: ModelConfig, kind: str, owned: range | None = None) -> int:
    """Assembly buffer sets of a stage kind: decoder layers share a ring of two (one computing, one
    loading) where a device runs more than one, the embedding and the head have one each."""
    return 2 if kind == "layer" and len(owned_layers(cfg, owned)) > 1 else 1


def largest_matrix_numel(cfg: ModelConfig, owned: range | None = None) -> int:
    """Elements of the biggest 2-D weight of the stages run here."""
    return _largest_numel(_spec_lists(cfg, owned), per_stage=False)


def _spec_lists(cfg: ModelConfig, owned: range | None) -> list[list[WeightSpec]]:
    return [stage_specs(cfg, stage) for stage in owned_stages(cfg, owned)]


def _largest_numel(spec_lists: list[list[WeightSpec]], per_stage: bool) -> int:
    """Elements of the biggest compressible matrix of these stages' specs, or with ``per_stage``
    of the stage whose compressible matrices have the most together."""
    per_list = (sum(s.numel for s in specs if compressible(s)) if per_stage
                else max((s.numel for s in specs if compressible(s)), default=0) for specs in spec_lists)
    return max(per_list, default=0)


def dequantizes_once(policy) -> bool:
    """Whether a stage's compressed matrices are dequantized for all the block's GPU batches at once
    (into a buffer for the whole stage) rather than per batch, each just before use (into one
    matrix's scratch): where several batches share the stage. With CPU attention the last batch's
    second half of a layer runs after the next layer's first half has begun to fill the buffer, but
    a stage's matrices are placed in the order they are read, and every layer's first half reads
    the same ones, so what the second half still needs stays in place. ``policy``: a Policy or the
    planner's frame of one."""
    return policy.compress_weight is not None and policy.num_gpu_batches > 1


def largest_stage_matrix_numel(cfg: ModelConfig, owned: range | None = None) -> int:
    """Elements of the compressible matrices of the stage run here that has the most."""
    return _largest_numel(_spec_lists(cfg, owned), per_stage=True)


def dequantize_scratch_numel(cfg: ModelConfig, compression: CompressionConfig | None, per_stage: bool = False,
                             owned: range | None = None) -> int:
    """Elements of the buffer compressed matrices are dequantized into: the largest matrix, or with
    ``per_stage`` the largest stage's matrices together."""
    return 0 if compression is None else _largest_numel(_spec_lists(cfg, owned), per_stage)


def stored_parts(shape: tuple[int, ...], compression: CompressionConfig | None, itemsize: int,
                 meta_itemsize: int | None = None) -> list[int]:
    """Bytes of each tensor a stored weight or KV buffer of ``shape`` (``itemsize``-byte values) is
    allocated as: itself, or once compressed group-wise along its last dimension, its packed codes,
    scales and minimums (``meta_itemsize`` bytes each; default: the values')."""
    if compression is None:
        return [math.prod(shape) * itemsize]
    rows = math.prod(shape[:-1])
    groups = -(-shape[-1] // compression.group_size)
    meta = rows * groups * (itemsize if meta_itemsize is None else meta_itemsize)
    return [rows * packed_row_bytes(shape[-1], compression.bits), meta, meta]


def weight_meta_dtype(cfg: ModelConfig, compression: CompressionConfig | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype of compressed weights' scales and minimums under ``dtype`` compute: its own, but
    float16 where bfloat16 compute reads the weights in the format the checkpoint stores them in
    (a GGUF's scales and minimums are fp16, which bf16 would round). One for every compressed
    weight of the model, stored or quantized here, so that its pieces and buffers agree."""
    if dtype == torch.bfloat16 and compression is not None and compression == cfg.stored_compression:
        return torch.float16
    return dtype


def stage_placements(cfg: ModelConfig, policy: Policy, owned: range | None = None) -> dict[Stage, list[TensorPlacement]]:
    """Which rows of each stage's tensors (of the stages run here) live on which tier."""
    return {stage: place_layer(stage_specs(cfg, stage), policy.weights, policy.expert_fractions)
            for stage in owned_stages(cfg, owned)}


@dataclass(frozen=True)
class WeightLayout:
    """Every weight allocation of a policy, in bytes.

    ``stage_tiers``: each stage's stored bytes per tier (disk bytes are its file's content);
    ``buffers``: GPU bytes of each stage kind's assembly buffer sets, all copies; ``staging``: host
    bytes of one buffer set's staging for the kind's disk pieces; ``scratch``: GPU bytes compressed
    matrices are dequantized into; ``host_requests``: the weight store's host allocations in its order.
    """

    stage_tiers: dict[Stage, dict[str, int]]
    buffers: dict[str, int]
    staging: dict[str, int]
    scratch: int
    host_requests: list[int]

    def tier_bytes(self, pinned: bool = False) -> dict[str, int]:
        """Bytes per tier, with the GPU buffers and scratch. ``pinned``: host memory is pinned, so
        the CPU figure is the whole pages each allocation is registered in (disk stages' host
        staging included)."""
        sizes = {tier: sum(stage[tier] for stage in self.stage_tiers.values()) for tier in TIERS}
        sizes["gpu"] += self.buffer_bytes
        sizes["cpu"] = registered_bytes(self.host_requests) if pinned else sum(self.host_requests)
        return sizes

    @property
    def buffer_bytes(self) -> int:
        return sum(self.buffers.values()) + self.scratch

    def disk_files(self) -> dict[str, int]:
        """Size of each stage's offload file, by the file's name (the stage's)."""
        return {stage.name: disk_file_bytes(sizes["disk"]) for stage, sizes in self.stage_tiers.items()
                if sizes["disk"]}


def weight_layout(cfg: ModelConfig, policy: Policy, dtype: torch.dtype, owned: range | None = None) -> WeightLayout:
    """The weight allocations of the stages run here (all, or a pipeline stage's ``owned`` range)."""
    stage_tiers: dict[Stage, dict[str, int]] = {}
    buffers: dict[str, int] = {}
    staging: dict[str, int] = {}
    requests: list[int] = []
    compression = policy.compress_weight
    meta = weight_meta_dtype(cfg, compression, dtype).itemsize
    # Per stage kind, the stored bytes of each tensor some stage of the kind streams: its buffers
    # have a place for each (a MoE model's dense and sparse layers stream different tensors).
    streamed: dict[str, dict[str, int]] = {}
    # Stages whose tensors agree in all but their checkpoint keys (a model's decoder layers) are
    # placed and sized alike: each kind of them is worked out once, which a search does thousands of times.
    alike: dict[tuple, tuple[dict[str, int], list[int], dict[str, int]]] = {}
    distinct: list[list[WeightSpec]] = []
    for stage in owned_stages(cfg, owned):
        specs = stage_specs(cfg, stage)
        key = (stage.kind, *((spec.name, spec.shape, spec.quantizable, spec.experts) for spec in specs))
        if key not in alike:
            distinct.append(specs)
            alike[key] = _stage_sizes(place_layer(specs, policy.weights, policy.expert_fractions), compression,
                                      dtype.itemsize, meta)
        sizes, on_cpu, whole = alike[key]
        requests += on_cpu
        streamed.setdefault(stage.kind, {}).update(whole)
        stage_tiers[stage] = dict(sizes)
        buffers[stage.kind] = buffer_copies(cfg, stage.kind, owned) * sum(streamed[stage.kind].values())
        staging[stage.kind] = max(staging.get(stage.kind, 0), sizes["disk"])
    # Each buffer set has its host staging for disk pieces, made after every stage's pieces.
    for kind, disk in staging.items():
        if disk and buffers[kind]:
            requests += [disk] * buffer_copies(cfg, kind, owned)
    # dequantize_scratch_numel's figure, from the specs at hand: stages alike have the same matrices
    scratch = 0 if compression is None else _largest_numel(distinct, dequantizes_once(policy)) * dtype.itemsize
    return WeightLayout(stage_tiers, buffers, staging, scratch, requests)


def _stage_sizes(placed: list[TensorPlacement], compression, itemsize: int, meta: int):
    """A stage's stored bytes per tier, its host allocations in order, and the stored size of each
    tensor it streams (one with any rows off the GPU, assembled whole, compressed or not)."""
    sizes = dict.fromkeys(TIERS, 0)
    on_cpu: list[int] = []
    whole: dict[str, int] = {}
    for placement in placed:
        spec = placement.spec
        compressed = compression if compression is not None and compressible(spec) else None
        for piece in placement.pieces:
            parts = stored_parts((piece.stop - piece.start, *spec.shape[1:]), compressed, itemsize, meta)
            sizes[piece.tier] += sum(parts)
            if piece.tier == "cpu":
                on_cpu += parts
        if placement.only_tier != "gpu":
            whole[spec.name] = sum(stored_parts(spec.shape, compressed, itemsize, meta))
    return sizes, on_cpu, whole


def weight_bytes(cfg: ModelConfig, policy: Policy, dtype: torch.dtype, pinned: bool = False,
                 owned: range | None = None) -> dict[str, int]:
    """Bytes of weights per tier (compressed where the policy says), plus the GPU buffers that
    streamed stages are assembled and compressed matrices dequantized in (see WeightLayout)."""
    return weight_layout(cfg, policy, dtype, owned).tier_bytes(pinned)


def weight_host_requests(cfg: ModelConfig, policy: Policy, dtype: torch.dtype) -> list[int]:
    """The weight store's host allocations, in the order it makes them."""
    return weight_layout(cfg, policy, dtype).host_requests


def weight_buffer_bytes(cfg: ModelConfig, policy: Policy, dtype: torch.dtype) -> int:
    """GPU bytes of the buffers streamed stages are assembled in (a layer's ring of two, and one each
    for the embedding and the head where they stream), and of the scratch compressed matrices are
    dequantized into. A tensor with any rows off the GPU is assembled whole, compressed or not."""
    return weight_layout(cfg, policy, dtype).buffer_bytes
