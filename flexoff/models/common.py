"""Pieces every architecture shares: weight specs, the attention interface, and the attention math.

The model files know nothing of where tensors live. A layer receives its weights as a dict and an
``attend`` callable from the runtime; ``attend`` stores the new keys/values wherever the cache
lives and returns the attention output, so the same layer math serves every placement.
Each architecture also exposes the layer's two halves, ``attention_inputs`` (up to q, k, v) and
``after_attention`` (from the attention output on; ``layer`` is their composition), so that the
runtime can run attention elsewhere (on the CPU) while the GPU works on other batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# attend(q, k_new, v_new) -> out. q: (batch, heads, seq, head_dim); k_new, v_new:
# (batch, kv_heads, seq, head_dim) for the tokens of this step; out has q's shape.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class WeightSpec:
    """One weight tensor of a stage: its key inside the stage, checkpoint names, shape and dummy init."""

    name: str
    checkpoint_keys: tuple[str, ...]  # first match wins; later keys cover other exports and tied weights
    shape: tuple[int, ...]
    init: str = "normal"  # "normal" | "norm" | "bias": how dummy weights are drawn
    # Where checkpoints store the tensor in pieces (experts saved one by one): alternatives, tried
    # after checkpoint_keys, each listing per row of the first dimension the keys whose tensors,
    # concatenated along their rows, make that row.
    stacked: tuple[tuple[tuple[str, ...], ...], ...] = ()
    quantizable: bool = True  # False keeps a matrix exact under weight compression (a router)
    experts: bool = False  # rows are a layer's experts: placed by the policy's expert fractions

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def spec(name: str, shape: tuple[int, ...], prefixes: tuple[str, ...], init: str = "normal",
         extra_keys: tuple[str, ...] = (), **fields) -> WeightSpec:
    return WeightSpec(name, tuple(prefix + name for prefix in prefixes) + extra_keys, shape, init, **fields)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


# On CUDA, the memory-efficient kernel takes any key length as it comes. cuDNN's kernel builds
# a plan per new shape, and decode brings a new key length every step: that cost 2-3x decode time.
_CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention with grouped KV heads.

    q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, keys, head_dim);
    mask: bool (batch, 1, seq, keys), True where a query may attend, or that mask as
    :func:`attention_bias` makes it. Every row must allow at least one key, otherwise softmax
    yields NaN that would leak through the cache.
    """
    batch, heads, seq, head_dim = q.shape
    groups = heads // k.shape[1]
    if groups > 1:
        # Fold each KV head's group of query heads into its query rows instead of copying the
        # cache once per query head: (batch, kv_heads, groups * seq, head_dim).
        q = q.reshape(batch, k.shape[1], groups * seq, head_dim)
        if seq > 1:
            mask = mask.repeat(1, 1, groups, 1)
    if q.is_cuda:
        with sdpa_kernel(_CUDA_BACKENDS):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.reshape(batch, heads, seq, head_dim)


# The memory-efficient CUDA kernel reads a bias whose strides (but the last) are multiples of this
# many entries; it pads any other bias into a new tensor on every call.
BIAS_ALIGNMENT = 16


def bias_row_entries(keys: int) -> int:
    """Entries a bias row over ``keys`` keys is stored in: ``keys`` rounded up to BIAS_ALIGNMENT."""
    return -(-keys // BIAS_ALIGNMENT) * BIAS_ALIGNMENT


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive bias attention turns it into (0 where a query may attend,
    -inf elsewhere, in ``dtype``), so that the step's layers share one conversion instead of each
    converting, and on CUDA padding, the mask again. Each row is stored in ``bias_row_entries``
    entries, and the bias is a view of its first ``keys`` columns."""
    keys = mask.shape[-1]
    bias = torch.full((*mask.shape[:-1], bias_row_entries(keys)), float("-inf"), dtype=dtype, device=mask.device)
    return bias[..., :keys].masked_fill_(mask, 0.0)


def attention_mask(valid: torch.Tensor, start: int, num_queries: int) -> torch.Tensor:
    """Mask for queries at cache slots [start, start + num_queries) over keys [0, start + num_queries).

    valid: bool (batch, slots), False at left padding. Queries see earlier valid keys and always
    themselves, so padded query rows stay finite without affecting real ones.
    Returns bool (batch, 1, num_queries, start + num_queries).
    """
    total = start + num_queries
    key_index = torch.arange(total, device=valid.device)
    query_index = torch.arange(start, total, device=valid.device)
    causal = key_index[None, :] <= query_index[:, None]
    diagonal = key_index[None, :] == query_index[:, None]
    mask = (causal[None] & valid[:, None, :total]) | diagonal[None]
    return mask[:, None]


# Scores ``attention_lse_by_parts`` makes at once (all rows, a slice of the queries): a long prefill
# over a long prefix goes a slice of queries at a time, within about 100 MB beside the layout's
# working memory (the scores in the inputs' dtype, in fp32, and as weights).
LSE_SCORE_ENTRIES = 1 << 23


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also gives each query's log-sum-exp of its scores, so that attention
    over two sets of keys (a shared prefix, a row's own tokens) merges exactly
    (:func:`merge_attention`). Shapes as :func:`attention`; ``mask`` None lets every query see
    every key, and a mask of one query row applies to all. As for :func:`attention`, every query
    must see at least one key. Returns (out in q's dtype, lse as fp32 (batch, heads, seq, 1)).

    A decode step calls this for every layer of every batch, twice, and a shared prefill over
    every prefix: it runs as one fused kernel where torch has one for the inputs (the
    memory-efficient kernel on CUDA, the flash kernel on the CPU), and by parts otherwise."""
    batch, heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    folded = q.reshape(batch, kv_heads, groups * seq, head_dim)
    if mask is not None and groups > 1 and mask.shape[2] > 1:
        mask = mask.repeat(1, 1, groups, 1)
    if _fuses(q):
        out, lse = _fused_lse(folded, k, v, mask)
    else:
        out, lse = attention_lse_by_parts(folded, k, v, mask)
    return out.reshape(batch, heads, seq, head_dim), lse.reshape(batch, heads, seq, 1)


_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fuses(q: torch.Tensor) -> bool:
    """Whether the fused kernels take these queries (the memory-efficient kernel's head sizes)."""
    head_dim = q.shape[-1]
    return q.numel() > 0 and q.dtype in _FUSED_DTYPES and head_dim % 8 == 0 and head_dim <= 256 \
        and q.device.type in ("cuda", "cpu")


def _fused_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel's attention and log-sum-exp, heads already alike: (batch, heads, seq, head_dim)
    and fp32 (batch, heads, seq)."""
    batch, heads, seq, _ = q.shape
    bias = mask
    if mask is not None and mask.dtype == torch.bool:
        bias = attention_bias(mask, q.dtype)
    elif mask is not None and (mask.dtype != q.dtype or (mask.shape[-2] > 1 and mask.stride(-2) % BIAS_ALIGNMENT)):
        bias = _aligned(mask.to(q.dtype))
    if bias is not None:
        # The kernels take a bias of the scores' full shape; broadcast dimensions are stride 0.
        bias = bias.expand(batch, heads, seq, k.shape[2])
    if q.is_cuda:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)
        return out, lse[..., :seq]  # the kernel pads its lse rows to a multiple of 32 queries
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias)


def _aligned(bias: torch.Tensor) -> torch.Tensor:
    """``bias`` copied into rows of ``bias_row_entries`` entries, as the CUDA kernel reads them."""
    keys = bias.shape[-1]
    room = bias.new_empty((*bias.shape[:-1], bias_row_entries(keys)))[..., :keys]
    return room.copy_(bias)


def attention_lse_by_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_lse` without a fused kernel, heads already alike: the products in the
    inputs' dtype, as the math kernel of ``scaled_dot_product_attention`` runs them, the softmax
    and its sums in fp32, a slice of the queries at a time (``LSE_SCORE_ENTRIES``)."""
    batch, heads, seq, head_dim = q.shape
    keys_t = k.transpose(-1, -2)
    step = max(1, LSE_SCORE_ENTRIES // max(1, batch * heads * k.shape[2]))
    outs, sums = [], []
    for start in range(0, seq, step):
        queries = slice(start, min(start + step, seq))
        scores = torch.matmul(q[:, :, queries], keys_t).float().mul_(head_dim ** -0.5)
        if mask is not None:
            part = mask[:, :, queries] if mask.shape[2] > 1 else mask
            if part.dtype == torch.bool:
                scores.masked_fill_(~part, float("-inf"))
            else:
                scores.add_(part)
        top = scores.amax(dim=-1, keepdim=True)
        weights = scores.sub_(top).exp_()
        total = weights.sum(dim=-1, keepdim=True)
        out = torch.matmul(weights.to(v.dtype), v)
        outs.append(out.div_(total.to(out.dtype)))
        sums.append(total.log_().add_(top))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    lse = sums[0] if len(sums) == 1 else torch.cat(sums, dim=2)
    return out, lse[..., 0]


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two sets of keys, from each set's output and log-sum-exp, in
    place in ``out_a``: b's share of the softmax's normaliser is sigmoid(lse_b - lse_a), so the
    union is a's output moved that far towards b's. A set a query sees no key of has lse -inf and
    a share of 0."""
    share = torch.sigmoid(lse_b - lse_a)
    return out_a.lerp_(out_b, share.to(out_a.dtype))
