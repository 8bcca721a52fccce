"""Decode attention on the CPU over a cache in host memory: which formulation streams keys fastest.

One decode step of one layer for a GPU batch of OPT-30B shape by default (32 sequences, 56 heads,
544 cached tokens, head_dim 128), in the cache's dtype. Prints GB/s of cache read.

    python bench/cpu_attention.py --rows 32 --heads 56 --tokens 544
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_chunks(q, k, v, mask, rows=4):
    out = torch.empty_like(q)
    for s in range(0, q.shape[0], rows):
        out[s:s + rows] = F.scaled_dot_product_attention(q[s:s + rows], k[s:s + rows], v[s:s + rows],
                                                         attn_mask=mask[s:s + rows])
    return out


def matmul_fp32_chunks(q, k, v, mask, rows=2):
    """Scores and weighted sum with fp32 matmuls, a few sequences at a time (cache-sized chunks)."""
    out = torch.empty_like(q)
    scale = q.shape[-1] ** -0.5
    for s in range(0, q.shape[0], rows):
        kk = k[s:s + rows].float()
        scores = torch.matmul(q[s:s + rows].float() * scale, kk.transpose(-1, -2))
        scores.masked_fill_(~mask[s:s + rows], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:s + rows] = torch.matmul(probs, v[s:s + rows].float()).to(q.dtype)
    return out


def matmul_native(q, k, v, mask):
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q * scale, k.transpose(-1, -2)).float()
    scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--tokens", type=int, default=544)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        shape = (args.rows, args.heads, args.tokens, args.head_dim)
        k = torch.randn(shape, dtype=dtype)
        v = torch.randn(shape, dtype=dtype)
        q = torch.randn(args.rows, args.heads, 1, args.head_dim, dtype=dtype)
        mask = torch.ones(args.rows, 1, 1, args.tokens, dtype=torch.bool)
        mask[:, :, :, :7] = False
        reference = matmul_fp32_chunks(q, k, v, mask).float()
        cache_bytes = 2 * k.numel() * k.element_size()
        for name, fn in (("sdpa", sdpa), ("sdpa 4-row chunks", sdpa_chunks), ("fp32 matmul chunks", matmul_fp32_chunks),
                         ("native matmul", matmul_native)):
            out = fn(q, k, v, mask)
            error = (out.float() - reference).abs().max().item()
            start = time.perf_counter()
            for _ in range(args.repeat):
                fn(q, k, v, mask)
            seconds = (time.perf_counter() - start) / args.repeat
            print(f"{str(dtype):15s} {name:20s} {seconds * 1e3:8.2f} ms  {cache_bytes / seconds / 1e9:7.1f} GB/s"
                  f"  max err {error:.1e}")


if __name__ == "__main__":
    main()
