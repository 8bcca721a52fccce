"""Which experts a block of tokens touches, and when loading only those pays.

Each token of a sparse layer picks ``k`` of its ``E`` experts. Under uniform routing a given expert
escapes one token with probability (E - k) / E, so N tokens touch E * (1 - ((E - k) / E) ** N)
distinct experts on average; real routers are less even, which only lowers the count.

Route-first loading runs a sparse layer's router before its experts are copied, then copies only
the experts the step's tokens chose. Its loads wait for the routing (they cannot run a stage ahead)
and the host reads the choice back, which costs about ROUTE_FIRST_COST of a decode step; so it is
kept only where the experts expected to be skipped, less that cost, are at least
ROUTE_FIRST_MIN_SAVING of them: blocks of one GPU batch of a few sequences (at most 5 for Mixtral's
2 of 8, 22 for Qwen3-MoE's 8 of 128; ``bench/expert_touch.py`` measures the touch curve,
``bench/route_first.py`` the time saved). Larger blocks touch nearly every expert, and load them
all a stage ahead.
"""

from __future__ import annotations

from ..models.config import ModelConfig

ROUTE_FIRST_MIN_SAVING = 0.10
# The share of a decode step route-first loading loses to waiting for the routing: bench/route_first.py,
# Mixtral-8x7B with 4-bit experts in CPU memory on an H100, saved 61%, 44% and 18% of a step with 75%,
# 56% and 32% of the experts untouched (1, 2 and 4 sequences), and lost 9% with 10% untouched (8).
ROUTE_FIRST_COST = 0.13


def expected_experts_touched(num_experts: int, experts_per_token: int, tokens: float) -> float:
    """Expected distinct experts that ``tokens`` tokens, each routed uniformly to
    ``experts_per_token`` distinct experts of ``num_experts``, touch together."""
    if num_experts <= 0:
        return 0.0
    missed = (num_experts - experts_per_token) / num_experts
    return num_experts * (1.0 - missed ** tokens)


def routes_first(cfg: ModelConfig, gpu_batch_size: int, num_gpu_batches: int) -> bool:
    """Whether a block of ``num_gpu_batches`` x ``gpu_batch_size`` sequences loads each sparse
    layer's experts after its router, only the chosen ones. One GPU batch only: with more, every
    batch would have to route before any expert could be loaded."""
    if not cfg.num_experts or num_gpu_batches != 1:
        return False
    touched = expected_experts_touched(cfg.num_experts, cfg.experts_per_token, gpu_batch_size)
    return 1.0 - touched / cfg.num_experts - ROUTE_FIRST_COST >= ROUTE_FIRST_MIN_SAVING
