"""Placement: which rows of which tensor live on which tier.

Weights are placed per stage so that the stage's bytes on each tier match the policy's fractions:
the stage's tensors are laid end to end and cut at the two fraction boundaries, and a tensor that
straddles a boundary is split between rows. The error is at most half a row per boundary, so a
25% request stays 25% (placing whole tensors by their midpoint turned 25% into 8% on OPT-30B).
KV cache and activations are split along the batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models import WeightSpec
from ..policy import TIERS, Policy, TierFractions


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of a tensor's first dimension on one tier."""

    tier: str
    start: int
    stop: int


@dataclass(frozen=True)
class TensorPlacement:
    spec: WeightSpec
    pieces: tuple[Piece, ...]

    @property
    def row_numel(self) -> int:
        return self.spec.numel // self.spec.shape[0]

    def numel_on(self, tier: str) -> int:
        return sum(p.stop - p.start for p in self.pieces if p.tier == tier) * self.row_numel

    @property
    def only_tier(self) -> str | None:
        """The tier holding the whole tensor, or None when it is split."""
        return self.pieces[0].tier if len(self.pieces) == 1 else None


def split_rows(rows: int, fractions: TierFractions) -> list[Piece]:
    """Cut ``rows`` into gpu / cpu / disk pieces by rounding the cumulative fraction boundaries."""
    gpu_end = round(rows * fractions.gpu)
    cpu_end = max(gpu_end, round(rows * (fractions.gpu + fractions.cpu)))
    bounds = {"gpu": (0, gpu_end), "cpu": (gpu_end, cpu_end), "disk": (cpu_end, rows)}
    return [Piece(tier, start, stop) for tier, (start, stop) in bounds.items() if stop > start]


@dataclass(frozen=True)
class CacheRows:
    """Rows [start, stop) of a GPU batch's cache on one tier; ``on_host``: their decode attention
    runs on the host (CPU attention) instead of on the GPU."""

    tier: str
    start: int
    stop: int
    on_host: bool = False

    @property
    def count(self) -> int:
        return self.stop - self.start

    @property
    def travels(self) -> bool:
        """Loaded to the GPU workspace for each decode step."""
        return self.tier != "gpu" and not self.on_host


def cache_rows(rows: int, policy: Policy) -> list[CacheRows]:
    """The cache's row groups of a GPU batch of ``rows`` sequences, in row order: gpu rows, cpu rows
    that travel, cpu rows attended on the host (``policy.cpu_attention_split`` of the cpu rows,
    rounded like the tier split), then disk rows (on the host with CPU attention). Travelling rows
    and host-attended rows each stay contiguous, so each is one span of the batch."""
    groups = []
    for piece in split_rows(rows, policy.cache):
        if piece.tier == "gpu":
            groups.append(CacheRows("gpu", piece.start, piece.stop))
        elif piece.tier == "disk":
            groups.append(CacheRows("disk", piece.start, piece.stop, policy.cpu_attention))
        else:
            attended = round((piece.stop - piece.start) * policy.cpu_attention_split) if policy.cpu_attention else 0
            cut = piece.stop - attended
            groups += [CacheRows("cpu", start, stop, on_host) for start, stop, on_host
                       in ((piece.start, cut, False), (cut, piece.stop, True)) if stop > start]
    return groups


def place_stage(specs: list[WeightSpec], fractions: TierFractions) -> list[TensorPlacement]:
    """Assign every row of every tensor of one stage to a tier (see the module docstring)."""
    total = sum(spec.numel for spec in specs)
    boundaries = (fractions.gpu * total, (fractions.gpu + fractions.cpu) * total)
    placements = []
    cursor = 0
    for spec in specs:
        rows = spec.shape[0]
        row_numel = spec.numel // rows

        def cut(boundary: float) -> int:
            # The row edge nearest to the boundary, clamped to this tensor.
            return min(rows, max(0, round((boundary - cursor) / row_numel)))

        edges = (0, cut(boundaries[0]), max(cut(boundaries[0]), cut(boundaries[1])), rows)
        pieces = tuple(Piece(tier, edges[i], edges[i + 1]) for i, tier in enumerate(TIERS)
                       if edges[i + 1] > edges[i])
        placements.append(TensorPlacement(spec, pieces))
        cursor += spec.numel
    return placements


def realised_fractions(placements: list[TensorPlacement]) -> dict[str, float]:
    total = sum(p.spec.numel for p in placements)
    return {tier: sum(p.numel_on(tier) for p in placements) / total for tier in TIERS}
