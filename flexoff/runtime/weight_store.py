"""Weights placed across tiers, and streamed to the compute device a stage ahead of use.

Tensors wholly on the GPU are used in place. The others are assembled, before their stage runs, in
a GPU buffer: decoder layers share a ring of two buffer sets (one computing, one loading), the
embedding and head stages have one set each. Host pieces are copied on the load stream; disk pieces
are read by the disk tier's threads into pinned staging, then copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models import ModelConfig, stage_names, stage_specs
from .placement import TensorPlacement, place_stage, realised_fractions
from .policy import TIERS, Policy
from .tiers import DiskRegion, DiskTier, HostMemory, Streams


def stage_kind(stage: str) -> str:
    return "layer" if stage.startswith("layer.") else stage


@dataclass
class _StagePieces:
    resident: dict[str, torch.Tensor] = field(default_factory=dict)  # whole tensors on the GPU
    # name -> list of (start row, stop row, storage); storage is a GPU or host tensor, or an
    # element offset into the stage's disk region, which holds all its disk pieces end to end
    parts: dict[str, list] = field(default_factory=dict)
    region: DiskRegion | None = None
    disk_numel: int = 0


@dataclass
class _BufferSet:
    tensors: dict[str, torch.Tensor]
    staging: torch.Tensor | None  # pinned host bytes for this stage's disk pieces
    holder: str | None = None  # stage whose weights are (being) loaded here
    ready: object = None  # event: the loads are done
    free: object = None  # event: the last compute that read these buffers is done
    pending: object = None  # future of a load running on the disk threads


class TieredWeights:
    def __init__(self, cfg: ModelConfig, source, policy: Policy, device: torch.device, dtype: torch.dtype,
                 streams: Streams, disk: DiskTier | None):
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.streams = streams
        self.host = HostMemory(policy.pin_cpu_memory)
        self._disk = disk
        self.placements = {stage: place_stage(stage_specs(cfg, stage), policy.weights) for stage in stage_names(cfg)}
        self.bytes = {tier: 0 for tier in TIERS}
        self._stages: dict[str, _StagePieces] = {}
        for stage, placements in self.placements.items():
            # One stage at a time: the source's copy is dropped before the next stage is read.
            self._stages[stage] = self._materialise(source, stage, placements, disk)
        self._buffers = self._make_buffers()

    def _materialise(self, source, stage: str, placements: list[TensorPlacement], disk) -> _StagePieces:
        pieces = _StagePieces()
        region: DiskRegion | None = None
        disk_numel = sum(p.numel_on("disk") for p in placements)
        if disk_numel:
            region = disk.allocate(stage, disk_numel * self.dtype.itemsize)
        disk_offset = 0
        for placement in placements:
            spec = placement.spec
            if placement.only_tier == "gpu":
                pieces.resident[spec.name] = source.load_tensor(stage, spec, self.device, self.dtype)
                self.bytes["gpu"] += spec.numel * self.dtype.itemsize
                continue
            if placement.only_tier == "cpu":  # straight into (pinned) host memory, with no extra copy
                storage = self.host.empty(spec.shape, self.dtype)
                source.load_tensor(stage, spec, storage.device, self.dtype, out=storage)
                self.bytes["cpu"] += spec.numel * self.dtype.itemsize
                pieces.parts[spec.name] = [(0, spec.shape[0], storage)]
                continue
            full = source.load_tensor(stage, spec, torch.device("cpu"), self.dtype)
            parts = []
            for piece in placement.pieces:
                rows = full[piece.start:piece.stop]
                size = rows.numel() * self.dtype.itemsize
                if piece.tier == "gpu":
                    storage = rows.to(self.device)
                elif piece.tier == "cpu":
                    storage = self.host.empty(rows.shape, self.dtype)
                    storage.copy_(rows)
                else:
                    region.write(rows, disk_offset * self.dtype.itemsize)
                    storage = disk_offset
                    disk_offset += rows.numel()
                self.bytes[piece.tier] += size
                parts.append((piece.start, piece.stop, storage))
            pieces.parts[spec.name] = parts
            del full
        pieces.disk_numel = disk_numel
        pieces.region = region
        return pieces

    def _make_buffers(self) -> dict[str, list[_BufferSet]]:
        """Assembly buffers per stage kind, sized by the kind's largest stage."""
        buffers: dict[str, list[_BufferSet]] = {}
        for stage in stage_names(self.cfg):
            kind = stage_kind(stage)
            pieces = self._stages[stage]
            if kind in buffers or not pieces.parts:
                continue
            specs = {p.spec.name: p.spec for p in self.placements[stage]}
            count = 2 if kind == "layer" and self.cfg.num_layers > 1 else 1
            disk_numel = max(self._stages[s].disk_numel for s in stage_names(self.cfg) if stage_kind(s) == kind)
            buffers[kind] = [
                _BufferSet(
                    {name: torch.empty(specs[name].shape, device=self.device, dtype=self.dtype) for name in pieces.parts},
                    self.host.empty((disk_numel,), self.dtype) if disk_numel else None,
                )
                for _ in range(count)
            ]
        self.buffer_bytes = sum(t.numel() * t.element_size() for sets in buffers.values() for s in sets
                                for t in s.tensors.values())
        return buffers

    def _set_for(self, stage: str) -> _BufferSet | None:
        sets = self._buffers.get(stage_kind(stage))
        if not sets:
            return None
        index = int(stage.split(".")[1]) % len(sets) if stage_kind(stage) == "layer" else 0
        return sets[index]

    def prefetch(self, stage: str) -> None:
        """Start assembling ``stage``'s weights on the GPU (a no-op if they are resident).

        Stages with disk pieces load on the disk tier's threads, so a slow read never holds up
        the compute being enqueued meanwhile.
        """
        buffer = self._set_for(stage)
        if buffer is None or buffer.holder == stage:
            return
        if buffer.pending is not None:
            buffer.pending.result()
        buffer.holder = stage
        if self._stages[stage].disk_numel:
            buffer.pending = self._disk.submit(self._load, stage, buffer)
        else:
            buffer.pending = None
            self._load(stage, buffer)

    def _load(self, stage: str, buffer: _BufferSet) -> None:
        pieces = self._stages[stage]
        streams = self.streams
        if pieces.disk_numel:
            # Copies out of staging for the previous stage must finish before it is refilled.
            if buffer.ready is not None:
                buffer.ready.synchronize()
            pieces.region.read_into(buffer.staging[:pieces.disk_numel])
        streams.wait(streams.load, buffer.free)
        with streams.on(streams.load):
            for name, parts in pieces.parts.items():
                target = buffer.tensors[name]
                for start, stop, storage in parts:
                    if isinstance(storage, int):  # an offset into the stage's disk bytes
                        rows = target[start:stop]
                        storage = buffer.staging[storage:storage + rows.numel()].view(rows.shape)
                    target[start:stop].copy_(storage, non_blocking=True)
        buffer.ready = streams.record(streams.load)

    def get(self, stage: str) -> dict[str, torch.Tensor]:
        """The stage's weights on the GPU, ready for compute enqueued after this call."""
        buffer = self._set_for(stage)
        pieces = self._stages[stage]
        if buffer is None:
            return pieces.resident
        if buffer.holder != stage:
            self.prefetch(stage)
        if buffer.pending is not None:
            buffer.pending.result()
            buffer.pending = None
        self.streams.wait(self.streams.compute, buffer.ready)
        weights = dict(pieces.resident)
        weights.update({name: buffer.tensors[name] for name in pieces.parts})
        return weights

    def release(self, stage: str) -> None:
        """The last compute reading ``stage``'s buffers has been enqueued; they may be reloaded after it."""
        buffer = self._set_for(stage)
        if buffer is not None:
            buffer.free = self.streams.record(self.streams.compute)

    def realised(self) -> dict[str, float]:
        """Fraction of all weight bytes on each tier, as placed."""
        everything = [p for placements in self.placements.values() for p in placements]
        return realised_fractions(everything)

    def max_layer_deviation(self, requested) -> float:
        """Largest |realised - requested| over stages and tiers, in fraction points."""
        worst = 0.0
        for placements in self.placements.values():
            got = realised_fractions(placements)
            worst = max(worst, *(abs(got[t] - getattr(requested, t)) for t in TIERS))
        return worst

    def close(self) -> None:
        self._stages.clear()
        self._buffers.clear()
        self.host.close()
