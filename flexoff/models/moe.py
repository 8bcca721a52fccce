"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top experts,
and the token's MLP output is their outputs weighted by the router's probabilities.

A layer's experts are stored stacked, one row of the first dimension per expert: ``gate_up``
(experts, 2 x width, hidden), gate rows then up rows, and ``down`` (experts, hidden, width). The
placement cuts tensors between rows, so each expert stays whole on one tier, and the layer's
tokens are grouped by expert so that each expert's rows run as one matmul.
"""

from __future__ import annotations

import functools
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from .common import WeightSpec, linear, spec
from .config import ModelConfig

# Elements of a chunk's sorted rows and experts' intermediates (about 1 GiB in 16 bits), the sparse
# layer's largest transient, so a long prefill goes in chunks. Larger chunks give each expert more
# rows, which the grouped kernel runs faster (bench/moe_kernel.py on an H100, bfloat16: Mixtral-8x7B
# 438 TFLOP/s at 2048 tokens, 522 at 4096; Qwen3-30B-A3B 124 at 2048, 198 at 8192).
CHUNK_ELEMENTS = 1 << 29

ROUTER = "mlp.router.weight"
GATE_UP = "mlp.experts.gate_up"
DOWN = "mlp.experts.down"


@runtime_checkable
class ExpertFetch(Protocol):
    """Where a sparse layer's experts are loaded once it has routed (route-first loading): the
    layer's caller passes one in, and the layer hands it each chunk's chosen experts before it
    reads the expert stacks, so that their rows are in place by then (the runtime's stage weights
    copy in those they do not hold yet). Without one, every expert is in place already."""

    def fetch_experts(self, experts: torch.Tensor) -> None:
        """``experts`` (tokens, k): the experts the tokens chose."""


def mlp_specs(cfg: ModelConfig, index: int) -> list[WeightSpec]:
    """The weights of a sparse layer's MLP. Checkpoints save experts one by one (Mixtral as
    ``block_sparse_moe.experts.N.w1/w2/w3``, Qwen as ``mlp.experts.N.gate_proj/up_proj/down_proj``)
    or, as transformers 5 holds them, already stacked (``mlp.experts.gate_up_proj``, ``down_proj``)."""
    p = f"model.layers.{index}."
    experts, hidden, width = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    mixtral, qwen = f"{p}block_sparse_moe.experts.", f"{p}mlp.experts."

    def per_expert(*names: tuple[str, ...]) -> tuple[tuple[tuple[str, ...], ...], ...]:
        return tuple(tuple(tuple(f"{prefix}{e}.{part}.weight" for part in parts) for e in range(experts))
                     for prefix, parts in zip((mixtral, qwen), names))

    specs = [
        # The router stays exact under compression: its probabilities choose the experts.
        WeightSpec(ROUTER, (f"{p}mlp.gate.weight", f"{p}block_sparse_moe.gate.weight"), (experts, hidden),
                   quantizable=False),
        WeightSpec(GATE_UP, (f"{p}mlp.experts.gate_up_proj",), (experts, 2 * width, hidden),
                   stacked=per_expert(("w1", "w3"), ("gate_proj", "up_proj")), experts=True),
        WeightSpec(DOWN, (f"{p}mlp.experts.down_proj",), (experts, hidden, width),
                   stacked=per_expert(("w2",), ("down_proj",)), experts=True),
    ]
    shared = cfg.shared_expert_intermediate_size
    if shared:
        specs += swiglu_specs("mlp.shared_expert.", hidden, shared, (p,))
        specs.append(WeightSpec("mlp.shared_expert_gate.weight", (f"{p}mlp.shared_expert_gate.weight",),
                                (1, hidden), quantizable=False))
    return specs


def chunk_tokens(cfg: ModelConfig) -> int:
    """Tokens routed together: the largest power of two whose pairs' gathered rows and gate-up
    outputs (hidden + 4 x width elements a pair, at their largest) fit in CHUNK_ELEMENTS; at least 1."""
    per_token = max(1, cfg.experts_per_token) * (cfg.hidden_size + 4 * cfg.expert_intermediate_size)
    return 1 << max(0, (CHUNK_ELEMENTS // per_token).bit_length() - 1)


def route(cfg: ModelConfig, router: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (tokens, hidden) -> (weights (tokens, k) in x's dtype, experts (tokens, k)). The softmax,
    the choice and the renormalisation run in fp32, as transformers computes them."""
    probs = torch.softmax(linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, cfg.experts_per_token, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows (n, in) sorted by expert, ``ends`` (experts,) int32 the end of each expert's rows, and
    weight (experts, out, in) -> (n, out): each expert's rows times its matrix."""
    if _grouped_kernel_fits(rows, weight):
        return F.grouped_mm(rows, weight.transpose(-2, -1), offs=ends)
    # Elsewhere, a matmul per expert; its bounds come to the host.
    bounds = [0, *ends.tolist()]
    return torch.cat([linear(rows[start:stop], weight[e]) for e, (start, stop) in enumerate(zip(bounds, bounds[1:]))])


def _grouped_kernel_fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    # The grouped kernel wants 16-byte aligned rows and bases. On an H100 it beat the loop in
    # fp16 too (4.6 against 7.3 ms a Qwen3-30B-A3B layer), and bfloat16 takes its fastest path.
    aligned = 16 // rows.element_size()
    return (rows.shape[-1] % aligned == 0 and weight.shape[-2] % aligned == 0
            and all(t.data_ptr() % 16 == 0 for t in (rows, weight)))


def fused_kernels(x: torch.Tensor):
    """The fused Triton kernels of :mod:`.moe_triton` where they run for ``x``: 16-bit values on a
    CUDA GPU of compute capability 8.0 or later (the grouped matmul's own floor), with Triton
    installed; else None."""
    if x.device.type != "cuda" or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    return _fused_module(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.cache
def _fused_module(device_index: int):
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return None
    try:
        from . import moe_triton
    except ImportError:
        return None
    return moe_triton


def expert_kernels(device: torch.device, dtype: torch.dtype) -> str:
    """How a sparse layer's routed experts run on ``device`` in ``dtype``, for a run's summary."""
    if fused_kernels(torch.empty(0, device=device, dtype=dtype)) is not None:
        return "grouped matmuls, fused triton steps"
    reason = "no gpu" if device.type != "cuda" else (
        "no triton or a gpu before compute capability 8.0" if dtype in (torch.float16, torch.bfloat16)
        else f"{str(dtype).removeprefix('torch.')} values")
    return f"grouped matmuls, unfused steps ({reason})"


def expert_mlp(cfg: ModelConfig, w, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
               fetch: ExpertFetch | None = None, fused: bool = True) -> torch.Tensor:
    """x (tokens, hidden) through each token's chosen experts, weighted: (tokens, hidden).

    The (token, choice) pairs are sorted by expert, so each expert multiplies its tokens in one
    matmul; the results are gathered back in pair order and each token's k rows are summed under
    their weights by one batched matmul (no atomic adds, so every run gives the same sums). Where
    the fused kernels run (``fused_kernels``) and ``fused`` allows them, the steps between and after
    the matmuls are one pass each."""
    tokens, k = experts.shape
    if fetch is not None:  # route-first loading: only the chosen experts are copied in, now
        fetch.fetch_experts(experts)
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    # Each expert's end in the sorted pairs. Not bincount: on CUDA it reads the largest id back to
    # the host, a synchronisation in every sparse layer of every batch.
    ends = torch.searchsorted(flat[order], torch.arange(1, cfg.num_experts + 1, device=flat.device,
                                                        dtype=flat.dtype)).to(torch.int32)
    rows = x[order // k]
    kernels = fused_kernels(x) if fused else None
    if kernels is not None:  # the routing weights applied before the down matmul, then one sum
        inner = kernels.silu_mul(grouped_linear(rows, w[GATE_UP], ends), weights, order)
        del rows
        out = grouped_linear(inner, w[DOWN], ends)
        return kernels.combine(out, _inverse(order), tokens, k)
    gate, up = grouped_linear(rows, w[GATE_UP], ends).chunk(2, dim=-1)
    out = grouped_linear(F.silu(gate) * up, w[DOWN], ends)
    where = _inverse(order)
    mine = out.index_select(0, where).view(tokens, k, -1)
    return torch.bmm(weights.unsqueeze(1), mine).squeeze(1)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """Where each pair sits in the sorted order. Outputs are gathered by it, not scattered by the
    order: on an H200 the scatter of a Qwen3-30B-A3B chunk took a fifth of the layer, the gather a
    tenth of that."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))


def sparse_mlp(cfg: ModelConfig, w, x: torch.Tensor, fetch: ExpertFetch | None = None,
               fused: bool = True) -> torch.Tensor:
    """A sparse layer's MLP on the normalised hidden x (batch, seq, hidden), chunk_tokens at a time;
    ``fetch``: where its experts load once routed (route-first loading), if anywhere; ``fused``:
    as :func:`expert_mlp` takes it."""
    flat, chunk = x.reshape(-1, x.shape[-1]), chunk_tokens(cfg)
    if len(flat) <= chunk:
        return _sparse_chunk(cfg, w, flat, fetch, fused).view_as(x)
    out = torch.empty_like(flat)
    for start in range(0, len(flat), chunk):
        out[start:start + chunk] = _sparse_chunk(cfg, w, flat[start:start + chunk], fetch, fused)
    return out.view_as(x)


def _sparse_chunk(cfg: ModelConfig, w, flat: torch.Tensor, fetch: ExpertFetch | None, fused: bool) -> torch.Tensor:
    weights, experts = route(cfg, w[ROUTER], flat)
    out = expert_mlp(cfg, w, flat, weights, experts, fetch, fused)
    if cfg.shared_expert_intermediate_size:
        shared = swiglu(w, flat, "mlp.shared_expert.")
        out = out + torch.sigmoid(linear(flat, w["mlp.shared_expert_gate.weight"])) * shared
    return out


def swiglu_specs(prefix: str, hidden: int, width: int, checkpoint_prefixes: tuple[str, ...]) -> list[WeightSpec]:
    """The weights :func:`swiglu` reads under ``prefix``, ``width`` wide."""
    shapes = {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
    return [spec(f"{prefix}{name}.weight", shape, checkpoint_prefixes) for name, shape in shapes.items()]


def swiglu(w, x: torch.Tensor, prefix: str) -> torch.Tensor:
    """A dense gated MLP; each matrix is read just before its matmul (see StageWeights)."""
    x = F.silu(linear(x, w[f"{prefix}gate_proj.weight"])) * linear(x, w[f"{prefix}up_proj.weight"])
    return linear(x, w[f"{prefix}down_proj.weight"])
