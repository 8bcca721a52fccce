"""How fast a sparse layer's routed experts run, by the experts' shape.

The runtime routes a chunk of tokens, sorts the (token, expert) pairs by expert, runs the grouped
matmuls and sums each token's choices (``models.moe``). That runs well below a dense matmul's rate
at the rows each expert gets, and how far below depends on the experts' shape (on an H100, 73% of
the dense curve for Mixtral-8x7B's eight wide experts, 28% for Qwen3-30B-A3B's 128 narrow ones;
``bench/moe_kernel.py``). So a profile may list, per shape, the measured FLOP/s of the experts each
token is routed to by how many tokens go through together; the planner falls back to the dense
curve for a shape the profile lacks.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ..models.config import ModelConfig

KEY = "sparse_mlp_flop_per_s"  # in a profile's compute section
SHAPE_KEYS = ("hidden", "width", "experts", "per_token")


def loglog(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The value at ``x`` interpolated log-log between (x, value) points; flat outside them."""
    xs = [p for p, _ in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def expert_shape(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(hidden, expert width, experts, experts a token) of a mixture of experts."""
    return cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts, cfg.experts_per_token


def active_flops_per_token(shape: tuple[int, int, int, int]) -> float:
    """FLOPs of one token through its routed experts: gate, up and down of each of its k."""
    hidden, width, _, per_token = shape
    return 2.0 * 3 * hidden * width * per_token


@dataclass(frozen=True)
class SparseRate:
    """Measured FLOP/s of one expert shape's routed experts, by tokens routed together."""

    shape: tuple[int, int, int, int]
    points: tuple[tuple[float, float], ...]  # (tokens, FLOP/s), tokens strictly increasing

    def flops_at(self, tokens: float, dense) -> float:
        """FLOP/s with ``tokens`` tokens routed together: log-log between the measured points, flat
        above the last; below the first, its rate scaled as the dense curve (``dense(rows)``)
        scales with the rows an expert gets."""
        first_tokens, first_rate = self.points[0]
        if tokens >= first_tokens:
            return loglog(self.points, tokens)
        share = self.shape[3] / self.shape[2]
        return first_rate * dense(max(tokens, 1.0) * share) / dense(first_tokens * share)

    def to_dict(self) -> dict:
        return {**dict(zip(SHAPE_KEYS, self.shape)), "points": [[t, f] for t, f in self.points]}
