"""The elementwise steps around a sparse layer's grouped matmuls, as fused Triton kernels (CUDA only).

Between its two grouped matmuls the plain path (``moe.expert_mlp``) runs the SiLU and the product
of gate and up as separate passes over every (token, choice) pair's row, and after them gathers the
rows back into pair order and sums each token's k rows by a batched matmul of one row, which
cuBLAS runs slowly: on an H100 those steps took 1.7 ms of a Qwen3-30B-A3B layer's 4.5 at 16384
tokens, the grouped matmuls 2.25 (``bench/moe_kernel.py --profile``). Here each is one pass:

- ``silu_mul``: each sorted pair's ``silu(gate) * up``, already scaled by its routing weight, so the
  down matmul's output is the weighted one;
- ``combine``: each token's k rows, read where the sort put them, summed in fp32, with no atomic
  adds: every run gives the same sums.

Importing this module needs Triton; :mod:`flexoff.models.moe` imports it only to use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Values a program takes along a row: a whole row of the widths in the registry (768 to 16384
# columns) in a few programs.
_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor, weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """gate_up (pairs, 2 x width) in expert order, gate columns then up columns; weights (tokens,
    k) the routing weights; ``order`` the pairs' flat indices in that order -> (pairs, width):
    ``silu(gate) * up`` times each pair's weight."""
    pairs, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(pairs, width)
    if pairs:
        _silu_mul_kernel[(pairs, triton.cdiv(width, _BLOCK))](
            gate_up, weights.reshape(-1), order, out, width, gate_up.stride(0), out.stride(0), BLOCK=_BLOCK)
    return out


def combine(rows: torch.Tensor, where: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """rows (pairs, hidden) in expert order; ``where`` (pairs,) each pair's row there, by flat
    index -> (tokens, hidden): the sum of each token's k rows."""
    hidden = rows.shape[1]
    out = rows.new_empty(tokens, hidden)
    if tokens:
        _combine_kernel[(tokens, triton.cdiv(hidden, _BLOCK))](
            rows, where, out, hidden, rows.stride(0), out.stride(0), K=k, BLOCK=_BLOCK)
    return out


# Counts only bound the grid, so they are compiled generic; widths and strides stay specialised,
# where their divisibility lets loads and stores vectorise.
@triton.jit
def _silu_mul_kernel(gate_up_ptr, weight_ptr, order_ptr, out_ptr, width, in_stride, out_stride,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * in_stride + width + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(weight_ptr + tl.load(order_ptr + row)).to(tl.float32)
    inner = gate * tl.sigmoid(gate) * up * scale
    tl.store(out_ptr + row * out_stride + cols, inner.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_kernel(rows_ptr, where_ptr, out_ptr, hidden, row_stride, out_stride,
                    K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for choice in tl.static_range(K):
        row = tl.load(where_ptr + token * K + choice).to(tl.int64)
        total += tl.load(rows_ptr + row * row_stride + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, total.to(out_ptr.dtype.element_ty), mask=ok)
