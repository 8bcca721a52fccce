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
from ..policy import TIERS, TierFractions


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


def place_layer(specs: list[WeightSpec], weights: TierFractions, experts: TierFractions) -> list[TensorPlacement]:
    """A stage's placement, in the specs' order: the tensors other than expert stacks cut end to end
    by ``weights`` (see :func:`place_stage`), and every expert stack (see WeightSpec.experts) cut at
    the same experts by ``experts``, so that each expert keeps all its matrices on one tier."""
    placed = {p.spec.name: p for p in place_stage([s for s in specs if not s.experts], weights)}
    for spec in specs:
        if spec.experts:
            placed[spec.name] = TensorPlacement(spec, tuple(split_rows(spec.shape[0], experts)))
    return [placed[spec.name] for spec in specs]


def requested_fractions(specs: list[WeightSpec], weights: TierFractions, experts: TierFractions) -> dict[str, float]:
    """The share of a stage's weight elements a policy asks for on each tier: ``weights`` and
    ``experts`` weighted by the elements each covers."""
    total = sum(spec.numel for spec in specs)
    in_experts = sum(spec.numel for spec in specs if spec.experts) / total
    return {tier: (1 - in_experts) * getattr(weights, tier) + in_experts * getattr(experts, tier) for tier in TIERS}


def realised_fractions(placements: list[TensorPlacement]) -> dict[str, float]:
    total = sum(p.spec.numel for p in placements)
    return {tier: sum(p.numel_on(tier) for p in placements) / total for tier in TIERS}
