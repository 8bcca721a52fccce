"""Attention with its log-sum-exp, fused kernel against by parts, at the shapes a shared prefix
gives it on OPT-30B (56 heads of 128): the rows of a GPU batch's groups over their prefixes at the
prefill (folded queries), and a decode step's two attentions (over the prefix, over the rows' own).

    python bench/attention_lse.py [--device cuda] [--dtype float16]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexoff.models.common import attention_bias, attention_lse, attention_lse_by_parts  # noqa: E402

# name: (batch, queries, keys, one-row key mask): the queries folded as the runtime folds them.
SHAPES = {
    "prefill over 480-token prefixes, 4 groups of 12 rows x 120": (4, 12 * 120, 480, True),
    "prefill of 48 rows' own 120 tokens": (48, 120, 120, False),
    "decode over 480-token prefixes, 4 groups of 12 rows": (4, 12, 480, True),
    "decode of 48 rows over their own 160 slots": (48, 1, 160, False),
}


def timed(fn, device, repeats):
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    heads, head_dim = 56, 128
    for name, (batch, queries, keys, one_row) in SHAPES.items():
        q = torch.randn(batch, heads, queries, head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(batch, heads, keys, head_dim, device=device, dtype=dtype) for _ in range(2))
        valid = torch.ones(batch, keys, dtype=torch.bool, device=device)
        valid[0, :keys // 8] = False
        mask = valid[:, None, None, :] if one_row else \
            attention_bias(valid[:, None, None, :].expand(batch, 1, queries, keys), dtype)
        inputs = (q, k, v, mask)
        fused = timed(partial(attention_lse, *inputs), device, args.repeats)
        parts = timed(partial(attention_lse_by_parts, *inputs), device, args.repeats)
        error = (attention_lse(*inputs)[0] - attention_lse_by_parts(*inputs)[0]).abs().max().item()
        print(f"{name}: fused {fused * 1e3:.3f} ms, by parts {parts * 1e3:.3f} ms, x{parts / fused:.2f}, "
              f"max |difference| {error:.2e}", flush=True)


if __name__ == "__main__":
    main()
