"""Weights placed across tiers, and streamed to the compute device a stage ahead of use.

Tensors wholly on the GPU are used in place. The others are assembled, before their stage runs, in
a GPU buffer: decoder layers share a ring of two buffer sets (one computing, one loading; a load
takes the set loaded longest ago), the embedding and head stages have one set each. Host pieces
are copied on the load stream; disk pieces are read by the disk tier's threads into pinned
staging, then copied.

With weight compression, matrices are quantized as they are loaded (one tensor at a time), or,
where the policy's format is the one the checkpoint stores them in (``ModelConfig.stored_compression``),
taken as the source stores them (``WeightSource.load_compressed``), never dequantized and quantized
again; they are stored compressed on every tier, so their bytes cross PCIe and disk compressed; they are assembled
compressed and dequantized on the compute stream as the layer reads each matrix, into the compute
dtype, whatever the dtype of their scales (``layout.weight_meta_dtype``: every compressed weight's). With one GPU
batch, or CPU attention, into one scratch buffer of the largest matrix's size: a stage's weights
are then a mapping (:class:`StageWeights`) whose compressed entries are valid until the next entry
is read, and the layers read each matrix just before the matmul that consumes it. Otherwise the
block's GPU batches share one dequantization of the stage: each matrix is dequantized on its first
read into its own place in a buffer the size of the largest stage, and later batches read it there
(a pass per batch cost as much GPU time as the copies it overlaps, and a launch per matrix and batch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from ..compression import CompressedTensor, dequantize, quantize
from ..errors import CheckpointError
from ..layout import (TensorPlacement, buffer_copies, compressible, dequantize_scratch_numel, dequantizes_once,
                      realised_fractions, requested_fractions, routes_first, stage_placements, weight_meta_dtype)
from ..models import ModelConfig, Stage, WeightSpec
from ..weights import WeightSource
from ..policy import TIERS, CompressionConfig, Policy
from .tiers import DiskRegion, DiskTier, HostMemory, Streams, device_allocator

Stored = torch.Tensor | CompressedTensor


def _parts(value: Stored) -> list[torch.Tensor]:
    return [value.data, value.scale, value.minimum] if isinstance(value, CompressedTensor) else [value]


def _nbytes(value: Stored) -> int:
    return sum(t.numel() * t.element_size() for t in _parts(value))


def _like(value: Stored, parts: list[torch.Tensor]) -> Stored:
    """A tensor of ``value``'s kind and layout over other storage."""
    if isinstance(value, CompressedTensor):
        return CompressedTensor(*parts, value.shape, value.dtype, value.dim, value.bits, value.group_size)
    return parts[0]


def _empty_like(value: Stored, allocate) -> Stored:
    return _like(value, [allocate(t.shape, t.dtype) for t in _parts(value)])


@dataclass
class _OnDisk:
    """A piece's bytes in the stage's disk region, and the layout to view them with."""

    offset: int
    template: Stored  # a host tensor of the piece's kind and shapes (its values are not used)

    def read_rows(self, region: DiskRegion, staging: torch.Tensor, start: int, stop: int) -> None:
        """Read rows [start, stop) of the piece (every part's) into ``staging`` where ``view`` sees them."""
        offset = self.offset
        for part in _parts(self.template):
            row = part[0].numel() * part.element_size()
            lo, hi = offset + start * row, offset + stop * row
            region.read_into(staging[lo:hi], lo)
            offset += part.numel() * part.element_size()

    def view(self, staging: torch.Tensor) -> Stored:
        views, offset = [], self.offset
        for part in _parts(self.template):
            size = part.numel() * part.element_size()
            views.append(staging[offset:offset + size].view(part.dtype).view(part.shape))
            offset += size
        return _like(self.template, views)


@dataclass
class _StagePieces:
    resident: dict[str, Stored] = field(default_factory=dict)  # wholly on the GPU (maybe compressed)
    # name -> list of (start row, stop row, storage): a GPU or host tensor (maybe compressed) or _OnDisk
    parts: dict[str, list] = field(default_factory=dict)
    # Expert stacks' host and disk pieces (also in ``parts``): with route-first loading, left out of
    # the stage's load and copied only for the experts a step's tokens chose, once it has routed.
    routed: dict[str, list] = field(default_factory=dict)
    routed_ids: set = field(default_factory=set)  # id() of their storage
    region: DiskRegion | None = None
    disk_bytes: int = 0


@dataclass
class _BufferSet:
    tensors: dict[str, Stored]  # assembled weights: in the compute dtype, or compressed
    staging: torch.Tensor | None  # pinned host bytes for this stage's disk pieces
    holder: Stage | None = None  # stage whose weights are (being) loaded here
    experts: set = field(default_factory=set)  # with route-first loading, the experts copied here so far
    ready: object = None  # event: the loads are done
    free: object = None  # event: the last compute that read these buffers is done
    pending: object = None  # future of a load running on the disk threads
    loaded: int = -1  # when a load last began here: the store's count of loads begun, then


class StageWeights(Mapping):
    """One stage's weights on the GPU by name. Compressed matrices are dequantized when read, on
    the current stream: without ``dequantized``, into a scratch buffer that the next read reuses
    (read each matrix just before the operation that consumes it, and do not keep it past the next
    read); with it (the stage's matrices dequantized so far, by name, shared by the stage's
    mappings), each into its own place in the scratch on first read, kept for later reads.

    It is also where the stage's experts load once a sparse layer has routed (``models.moe.ExpertFetch``)."""

    def __init__(self, tensors: dict[str, Stored], scratch: torch.Tensor | None,
                 dequantized: dict[str, torch.Tensor] | None = None,
                 fetch: Callable[[torch.Tensor], None] | None = None):
        self._fetch = fetch  # with route-first loading: copies chosen experts in
        self.routes_first = fetch is not None  # experts are copied in only once a layer has routed
        self._tensors = tensors
        self._scratch = scratch
        self._dequantized = dequantized

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._tensors[name]
        if not isinstance(value, CompressedTensor):
            return value
        if self._dequantized is None:
            return dequantize(value, out=self._scratch[:value.numel()].view(value.shape))
        done = self._dequantized.get(name)
        if done is None:
            used = sum(t.numel() for t in self._dequantized.values())
            done = dequantize(value, out=self._scratch[used:used + value.numel()].view(value.shape))
            self._dequantized[name] = done
        return done

    def dequantizes_on_read(self, name: str) -> bool:
        """Whether reading ``name`` dequantizes it into the scratch that the next read reuses."""
        return self._dequantized is None and isinstance(self._tensors[name], CompressedTensor)

    def read_tensors(self, name: str) -> list[torch.Tensor]:
        """The GPU tensors a read of ``name`` touches: those it is stored as, and any scratch it is dequantized into."""
        return _parts(self._tensors[name]) + ([self._scratch] if self.dequantizes_on_read(name) else [])

    def fetch_experts(self, experts: torch.Tensor) -> None:
        """Copy in those of the experts a sparse layer's tokens chose (tokens, k) that its buffers
        lack, for compute enqueued after this call; without route-first loading all are in place."""
        if self._fetch is not None:
            self._fetch(experts)

    def __contains__(self, name) -> bool:  # without reading (and dequantizing) the tensor
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as [first, last) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class TieredWeights:
    def __init__(self, cfg: ModelConfig, source: WeightSource, policy: Policy, device: torch.device, dtype: torch.dtype,
                 streams: Streams, disk: DiskTier | None, owned: range | None = None):
        """``owned``: the range of stage indices a pipeline stage runs (None: every stage); only
        their weights are placed."""
        self.cfg = cfg
        self.owned = owned
        self.device = device
        self.dtype = dtype
        self.streams = streams
        self.compression: CompressionConfig | None = policy.compress_weight
        # Matrices are read as the checkpoint stores them where the policy keeps its format.
        self.as_stored = self.compression is not None and self.compression == cfg.stored_compression
        self.meta_dtype = weight_meta_dtype(cfg, self.compression, dtype)  # of every compressed weight
        self.host = HostMemory(policy.pin_cpu_memory, exact=True)
        self._disk = disk
        self.placements = stage_placements(cfg, policy, owned)
        self._route_first = False  # for the block being run: see begin_block
        self._loads = 0  # loads begun into the buffer sets (_set_for takes the one loaded longest ago)
        self._fractions = (policy.weights, policy.expert_fractions)
        self.bytes = {tier: 0 for tier in TIERS}
        self._stages: dict[Stage, _StagePieces] = {}
        for stage, placements in self.placements.items():
            # One stage at a time: the source's copy is dropped before the next stage is read.
            self._stages[stage] = self._materialise(source, stage, placements)
        self._buffers = self._make_buffers()
        self._per_stage = dequantizes_once(policy)
        self._scratch = self._make_scratch()
        # The stage whose matrices the scratch holds (with _per_stage), and those read so far.
        self._dequantized: tuple[Stage | None, dict[str, torch.Tensor]] = (None, {})

    # Placing the weights
    def _compressed(self, spec: WeightSpec) -> bool:
        return self.compression is not None and compressible(spec)

    def _quantize(self, tensor: torch.Tensor) -> CompressedTensor:
        # Groups run along each row, so a piece of rows is itself a whole compressed tensor.
        return quantize(tensor, self.compression.bits, self.compression.group_size, dim=-1, meta_dtype=self.meta_dtype)

    def _load_compressed(self, source: WeightSource, stage: Stage, spec: WeightSpec, on_gpu: bool) -> CompressedTensor:
        """A compressible matrix, compressed: as the source stores it where the policy reads it so
        (on the device it lives on whole, else on the host, which its pieces are copied from), else
        quantized from its values."""
        if self.as_stored:
            device = self.device if on_gpu else torch.device("cpu")
            stored = source.load_compressed(stage.name, spec, self.compression, device, self.meta_dtype)
            if stored is not None:
                layout = (tuple(stored.shape), stored.bits, stored.group_size, stored.dim, stored.dtype)
                wanted = (tuple(spec.shape), self.compression.bits, self.compression.group_size, len(spec.shape) - 1,
                          self.meta_dtype)
                if layout != wanted:  # the store's pieces and buffers are laid out as ``wanted``
                    raise CheckpointError(f"{spec.name} of {stage.name} is stored as {stored!r}, not as "
                                          f"{tuple(spec.shape)} in {self.compression} with {self.meta_dtype} scales")
                return stored.to(device)
        # Quantize where it is fastest: on the GPU when there is one.
        return self._quantize(source.load_tensor(stage.name, spec, self.device, self.dtype))

    def _materialise(self, source: WeightSource, stage: Stage, placements: list[TensorPlacement]) -> _StagePieces:
        pieces = _StagePieces()
        on_disk: list[tuple[Stored, _OnDisk]] = []
        for placement in placements:
            spec = placement.spec
            compressed = self._compressed(spec)
            if placement.only_tier == "gpu" and not compressed:
                pieces.resident[spec.name] = source.load_tensor(stage.name, spec, self.device, self.dtype)
                self.bytes["gpu"] += spec.numel * self.dtype.itemsize
                continue
            if placement.only_tier == "cpu" and not compressed:  # straight into (pinned) host memory
                storage = self.host.empty(spec.shape, self.dtype)
                source.load_tensor(stage.name, spec, storage.device, self.dtype, out=storage)
                self.bytes["cpu"] += spec.numel * self.dtype.itemsize
                pieces.parts[spec.name] = [(0, spec.shape[0], storage)]
                if spec.experts:
                    pieces.routed[spec.name] = list(pieces.parts[spec.name])
                continue
            if compressed:
                full = self._load_compressed(source, stage, spec, placement.only_tier == "gpu")
                if placement.only_tier == "gpu":
                    pieces.resident[spec.name] = full
                    self.bytes["gpu"] += _nbytes(full)
                    continue
            else:
                full = source.load_tensor(stage.name, spec, torch.device("cpu"), self.dtype)
            parts = []
            for piece in placement.pieces:
                rows = full.narrow(0, piece.start, piece.stop - piece.start)
                if piece.tier == "gpu":
                    storage = _empty_like(rows, device_allocator(self.device))
                elif piece.tier == "cpu":
                    storage = _empty_like(rows, self.host.empty)
                else:  # a layout-only template on the meta device: shapes without memory
                    storage = _OnDisk(pieces.disk_bytes, _empty_like(rows, device_allocator("meta")))
                    pieces.disk_bytes += _nbytes(rows)
                    on_disk.append((rows, storage))
                if not isinstance(storage, _OnDisk):
                    for target, value in zip(_parts(storage), _parts(rows)):
                        target.copy_(value)
                self.bytes[piece.tier] += _nbytes(rows)
                parts.append((piece.start, piece.stop, storage))
            pieces.parts[spec.name] = parts
            routed = [part for part, piece in zip(parts, placement.pieces) if spec.experts and piece.tier != "gpu"]
            if routed:
                pieces.routed[spec.name] = routed
        pieces.routed_ids = {id(storage) for parts in pieces.routed.values() for _, _, storage in parts}
        if on_disk:  # the region's size is known once every piece of the stage is (maybe) compressed
            pieces.region = self._disk.allocate(stage.name, pieces.disk_bytes)
            for rows, where in on_disk:
                offset = where.offset
                for part in _parts(rows):
                    pieces.region.write(part.cpu(), offset)
                    offset += part.numel() * part.element_size()
        return pieces

    def _make_buffers(self) -> dict[str, list[_BufferSet]]:
        """Assembly buffers per stage kind: a place for every tensor any stage of the kind streams
        (a MoE model's dense layers stream other tensors than its sparse ones), and staging for the
        kind's largest disk share."""
        buffers: dict[str, list[_BufferSet]] = {}
        for kind in dict.fromkeys(stage.kind for stage in self._stages):  # in stage order, as the layout lists them
            of_kind = [stage for stage in self._stages if stage.kind == kind]
            specs = {p.spec.name: p.spec for stage in of_kind for p in self.placements[stage]
                     if p.spec.name in self._stages[stage].parts}
            if not specs:
                continue
            disk_bytes = max(self._stages[stage].disk_bytes for stage in of_kind)

            def assembly(spec: WeightSpec) -> Stored:
                c = self.compression
                if self._compressed(spec):
                    return CompressedTensor.empty(spec.shape, self.meta_dtype, c.bits, c.group_size, -1, self.device)
                return torch.empty(spec.shape, device=self.device, dtype=self.dtype)

            buffers[kind] = [
                _BufferSet({name: assembly(spec) for name, spec in specs.items()},
                           self.host.empty((disk_bytes,), torch.uint8) if disk_bytes else None)
                for _ in range(buffer_copies(self.cfg, kind, self.owned))
            ]
        return buffers

    def _make_scratch(self) -> torch.Tensor | None:
        """One dequantization buffer, the size of the largest compressed matrix."""
        numel = dequantize_scratch_numel(self.cfg, self.compression, self._per_stage, self.owned)
        return torch.empty(numel, device=self.device, dtype=self.dtype) if numel else None

    def _set_for(self, stage: Stage) -> _BufferSet | None:
        """The buffer set holding ``stage``, else the one a load of it takes: the set loaded longest
        ago. The schedule lets a load overwrite any stage's buffers but those of the stage loaded
        just before it, and a pipeline stage's range of layers wraps from its last to its first,
        which the parity of their indices could put in one set."""
        sets = self._buffers.get(stage.kind)
        if not sets:
            return None
        for buffer in sets:
            if buffer.holder == stage:
                return buffer
        return min(sets, key=lambda buffer: buffer.loaded)

    # Streaming
    def begin_block(self, rows: int, batches: int) -> None:
        """Before a block of ``batches`` GPU batches of up to ``rows`` sequences: whether its sparse
        layers load their experts route first (``layout.routes_first``). Not where the block's
        batches share one dequantization of a stage, which newly copied experts would leave stale.
        On a change, every buffer set forgets what it holds."""
        route_first = routes_first(self.cfg, rows, batches) and not self._per_stage
        if route_first == self._route_first:
            return
        self._route_first = route_first
        for sets in self._buffers.values():
            for buffer in sets:
                if buffer.pending is not None:
                    buffer.pending.result()
                    buffer.pending = None
                buffer.holder = None

    def prefetch(self, stage: Stage) -> None:
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
        buffer.loaded, self._loads = self._loads, self._loads + 1
        if self._stages[stage].disk_bytes:
            buffer.pending = self._disk.submit(self._load, stage, buffer)
        else:
            buffer.pending = None
            self._load(stage, buffer)

    def _load(self, stage: Stage, buffer: _BufferSet) -> None:
        pieces = self._stages[stage]
        streams = self.streams
        buffer.experts = set()
        if pieces.disk_bytes:
            # Copies out of staging for the previous stage must finish before it is refilled.
            if buffer.ready is not None:
                buffer.ready.synchronize()
            if self._route_first and pieces.routed:  # experts' rows are read once the router has chosen them
                for parts in pieces.parts.values():
                    for _, _, storage in parts:
                        if isinstance(storage, _OnDisk) and id(storage) not in pieces.routed_ids:
                            storage.read_rows(pieces.region, buffer.staging, 0, storage.template.shape[0])
            else:
                pieces.region.read_into(buffer.staging[:pieces.disk_bytes])
        streams.wait(streams.load, buffer.free)
        skipped = pieces.routed_ids if self._route_first else ()
        with streams.on(streams.load):
            for name, parts in pieces.parts.items():
                landing = buffer.tensors[name]
                for start, stop, storage in parts:
                    if id(storage) in skipped:
                        continue
                    if isinstance(storage, _OnDisk):
                        storage = storage.view(buffer.staging)
                    landing.narrow(0, start, stop - start).copy_(storage, non_blocking=True)
        buffer.ready = streams.record(streams.load)

    def get(self, stage: Stage) -> StageWeights:
        """The stage's weights on the GPU, ready for compute enqueued after this call."""
        buffer = self._set_for(stage)
        pieces = self._stages[stage]
        if buffer is None:
            return StageWeights(pieces.resident, self._scratch, self._dequantized_of(stage))
        if buffer.holder != stage:
            self.prefetch(stage)
        if buffer.pending is not None:
            buffer.pending.result()
            buffer.pending = None
        self.streams.wait(self.streams.compute, buffer.ready)
        weights = dict(pieces.resident)
        weights.update({name: buffer.tensors[name] for name in pieces.parts})
        fetch = partial(self._fetch_experts, pieces, buffer) if self._route_first and pieces.routed else None
        return StageWeights(weights, self._scratch, self._dequantized_of(stage), fetch)

    def _fetch_experts(self, pieces: _StagePieces, buffer: _BufferSet, experts: torch.Tensor) -> None:
        """Copy the host and disk rows of the experts in ``experts`` not copied yet into the
        stage's buffers, for compute enqueued after this call. The host reads the choice back: the
        copies cannot be enqueued before it is known."""
        wanted = sorted(set(experts.unique().tolist()) - buffer.experts)
        if not wanted:
            return
        buffer.experts.update(wanted)
        runs = _runs(wanted)
        streams = self.streams
        with streams.on(streams.load):
            for name, parts in pieces.routed.items():
                landing = buffer.tensors[name]
                for start, stop, storage in parts:
                    for first, last in runs:
                        lo, hi = max(first, start), min(last, stop)
                        if lo >= hi:
                            continue
                        if isinstance(storage, _OnDisk):
                            storage.read_rows(pieces.region, buffer.staging, lo - start, hi - start)
                            source = storage.view(buffer.staging)
                        else:
                            source = storage
                        landing.narrow(0, lo, hi - lo).copy_(source.narrow(0, lo - start, hi - lo), non_blocking=True)
        buffer.ready = streams.record(streams.load)
        streams.wait(streams.compute, buffer.ready)

    def _dequantized_of(self, stage: Stage) -> dict[str, torch.Tensor] | None:
        """The stage's matrices dequantized so far, when they are shared by its batches; reading
        another stage starts over (its reads are enqueued after every read of the one before, but
        the second half of a layer with CPU attention, which keeps the mapping it started with: see
        layout.dequantizes_once)."""
        if not self._per_stage:
            return None
        if self._dequantized[0] != stage:
            self._dequantized = (stage, {})
        return self._dequantized[1]

    def release(self, stage: Stage) -> None:
        """The last compute reading ``stage``'s buffers has been enqueued; they may be reloaded after it."""
        buffer = self._set_for(stage)
        if buffer is not None:
            buffer.free = self.streams.record(self.streams.compute)

    # Reports
    def requested(self) -> dict[str, float]:
        """Fraction of all weight elements the policy asks for on each tier (experts and the rest
        weighted by their elements)."""
        return requested_fractions([p.spec for placed in self.placements.values() for p in placed], *self._fractions)

    def realised(self) -> dict[str, float]:
        """Fraction of all weight elements on each tier, as placed."""
        everything = [p for placements in self.placements.values() for p in placements]
        return realised_fractions(everything)

    def max_layer_deviation(self) -> float:
        """Largest |realised - requested| over stages and tiers, in fraction points."""
        worst = 0.0
        for placements in self.placements.values():
            got = realised_fractions(placements)
            wanted = requested_fractions([p.spec for p in placements], *self._fractions)
            worst = max(worst, *(abs(got[t] - wanted[t]) for t in TIERS))
        return worst

    def first_non_finite(self) -> str | None:
        """'name of stage' for the first weight holding a NaN or an infinity as placed (after any
        conversion to the compute dtype, which may overflow); None if none does. Reads every piece
        once, disk pieces included: for naming a fault, never on the normal path."""
        for stage, pieces in self._stages.items():
            staging = None
            if pieces.disk_bytes:
                staging = pieces.region.read_into(torch.empty(pieces.disk_bytes, dtype=torch.uint8))
            stored = list(pieces.resident.items()) + [
                (name, storage.view(staging) if isinstance(storage, _OnDisk) else storage)
                for name, parts in pieces.parts.items() for _, _, storage in parts]
            for name, value in stored:
                if any(part.is_floating_point() and not bool(torch.isfinite(part).all()) for part in _parts(value)):
                    return f"{name} of {stage}"
        return None

    def close(self) -> None:
        self._stages.clear()
        self._buffers.clear()
        self._scratch = None
        self.host.close()
