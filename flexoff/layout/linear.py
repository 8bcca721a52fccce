"""A job's bytes per tier as a constant plus a coefficient per placement fraction, read off the
layout's own sizing (``job_bytes``), for a planner that weighs every placement of one frame.

The weights' bytes depend on the weight and expert fractions alone, a block's on the cache's and the
activations' alone, and each part of either on its own group's rows (its pieces, its buffers, its
host staging). So ``job_bytes`` with everything on the GPU, plus what moving one group wholly to
another tier adds, is ``job_bytes`` at every vertex: every group wholly on one tier, where no
tensor is split and every row count is whole. Between vertices the form interpolates; the layout
itself is not affine there (rows are whole, a tensor with any rows off the GPU is assembled whole).

With pinned host memory a block's cache and activations share slabs: where both are in host memory
the activations may fill the cache's slabs' free ends, which the form, counting the two apart, does
not see. There its CPU figure may be above the layout's, by at most the activations' own slabs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..models import ModelConfig
from ..policy import TIERS, Policy, TierFractions
from .block import block_bytes
from .weights import weight_bytes

# A placement's groups of fractions; "experts" only where the model stacks experts and the policy
# may place them apart (Policy.experts).
GROUPS = ("weights", "experts", "cache", "activations")
OFF_GPU = ("cpu", "disk")


def whole_tier(tier: str) -> TierFractions:
    """Every row of a group on ``tier``."""
    return TierFractions(*(1.0 if t == tier else 0.0 for t in TIERS))


@dataclass(frozen=True)
class MemoryForm:
    """Bytes per tier: ``constant`` (everything on the GPU) plus, for each group and each tier off
    the GPU, ``coefficients[(group, tier)]`` per tier times that group's fraction on that tier (a
    fraction on the GPU has none: the constant holds it)."""

    constant: dict[str, int]
    coefficients: dict[tuple[str, str], dict[str, int]]

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(g for g in GROUPS if (g, "cpu") in self.coefficients)

    def at(self, **fractions) -> dict[str, object]:
        """Bytes per tier where each group's (gpu, cpu, disk) fractions are given (floats, or numpy
        arrays of many placements at once); experts not given follow the weights."""
        fractions.setdefault("experts", fractions.get("weights"))
        result = {}
        for tier in TIERS:
            total = self.constant[tier]
            for group in self.groups:
                shares = dict(zip(TIERS, fractions[group]))
                for placed in OFF_GPU:
                    total = total + self.coefficients[(group, placed)][tier] * shares[placed]
            result[tier] = total
        return result


def memory_form(cfg: ModelConfig, policy: Policy, dtype: torch.dtype, prompt_len: int, gen_len: int,
                pinned: bool = False, *, prefix_len: int = 0, prefix_rows: int = 1) -> MemoryForm:
    """``job_bytes``' figure for ``policy``'s frame (its batches, compression, CPU attention) and
    ``prefix_rows`` shared prefixes of ``prefix_len`` tokens per GPU batch as a constant plus a
    coefficient per placement fraction; the policy's own fractions are not read. The prefixes' rows
    are placed as that many rows of their group are, so at a vertex, where every row of a group is
    on one tier, it is ``job_bytes``' too."""
    on_gpu = whole_tier("gpu")
    base = replace(policy, weights=on_gpu, cache=on_gpu, activations=on_gpu,
                   experts=on_gpu if cfg.num_experts else None)

    def weights(moved: Policy) -> dict[str, int]:
        return weight_bytes(cfg, moved, dtype, pinned)

    def block(moved: Policy) -> dict[str, int]:
        return block_bytes(cfg, moved, prompt_len, gen_len, dtype.itemsize, pinned, prefix_len=prefix_len,
                           prefix_rows=prefix_rows)

    parts = {"weights": weights, "experts": weights, "cache": block, "activations": block}
    constant = {tier: weights(base)[tier] + block(base)[tier] for tier in TIERS}
    coefficients = {}
    for group in GROUPS:
        if group == "experts" and not cfg.num_experts:
            continue
        measure = parts[group]
        at_base = measure(base)
        for placed in OFF_GPU:
            moved = measure(replace(base, **{group: whole_tier(placed)}))
            coefficients[(group, placed)] = {tier: moved[tier] - at_base[tier] for tier in TIERS}
    return MemoryForm(constant, coefficients)
