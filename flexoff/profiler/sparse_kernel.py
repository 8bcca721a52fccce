"""A sparse layer's routed experts timed as the runtime runs them (``models.moe``: routing, the sort by
expert, the grouped matmuls and the weighted sum), on one layer of random weights in the compute
dtype: for ``flexoff profile`` (each expert shape of the registry, on a GPU) and
``bench/moe_kernel.py``. The planner prices routed experts by these rates (planner.sparse_rate)."""

from __future__ import annotations

from typing import Callable

import torch

from ..models import REGISTRY, moe
from ..models.config import ModelConfig
from ..planner.sparse_rate import SparseRate, active_flops_per_token, expert_shape

# Tokens routed together, besides each shape's prefill chunk: decode steps of small and large GPU
# batches, and a short prefill.
TOKENS = (64, 256, 1024)


def layer_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> dict:
    """One sparse layer's router and experts (and shared expert, if any), random, scaled as an
    initialised model's are (so routing is not degenerate)."""
    width, hidden, experts = cfg.expert_intermediate_size, cfg.hidden_size, cfg.num_experts
    scale = hidden ** -0.5

    def draw(*shape):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    w = {moe.ROUTER: draw(experts, hidden), moe.GATE_UP: draw(experts, 2 * width, hidden),
         moe.DOWN: draw(experts, hidden, width)}
    shared = cfg.shared_expert_intermediate_size
    if shared:
        w.update({"mlp.shared_expert.gate_proj.weight": draw(shared, hidden),
                  "mlp.shared_expert.up_proj.weight": draw(shared, hidden),
                  "mlp.shared_expert.down_proj.weight": draw(hidden, shared),
                  "mlp.shared_expert_gate.weight": draw(1, hidden)})
    return w


def routed_experts(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    """x (tokens, hidden) through its routed experts only, as a sparse layer runs them."""
    weights, experts = moe.route(cfg, w[moe.ROUTER], x)
    return moe.expert_mlp(cfg, w, x, weights, experts)


def registry_shapes() -> dict[tuple[int, int, int, int], ModelConfig]:
    """Each expert shape of the registry's mixtures of experts, with the first model that has it."""
    shapes: dict[tuple[int, int, int, int], ModelConfig] = {}
    for cfg in REGISTRY.values():
        if cfg.num_experts:
            shapes.setdefault(expert_shape(cfg), cfg)
    return shapes


def measure_sparse_rates(device: torch.device, dtype: torch.dtype, seconds: Callable[[Callable], float],
                         configs=None, log=lambda message: None) -> tuple[tuple[SparseRate, ...], dict]:
    """(rates, raw timings) of each shape's routed experts at TOKENS and its prefill chunk;
    ``seconds(fn)`` times one call of ``fn``. ``configs``: the models whose shapes to measure
    (default: the registry's)."""
    configs = list(registry_shapes().values()) if configs is None else configs
    rates, raw = [], {}
    for cfg in configs:
        shape = expert_shape(cfg)
        log(f"routed experts of shape {shape} (hidden, width, experts, a token)")
        w = layer_weights(cfg, dtype, device)
        points = []
        for tokens in sorted({*(t for t in TOKENS if t < moe.chunk_tokens(cfg)), moe.chunk_tokens(cfg)}):
            x = (torch.randn(tokens, cfg.hidden_size, device=device)).to(dtype)
            took = seconds(lambda: routed_experts(cfg, w, x))
            points.append((float(tokens), active_flops_per_token(shape) * tokens / took))
        raw["x".join(map(str, shape))] = {"tokens": [p[0] for p in points], "flop_per_s": [p[1] for p in points]}
        rates.append(SparseRate(shape, tuple(points)))
        w = {}  # free the layer before the next shape's
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return tuple(rates), raw
