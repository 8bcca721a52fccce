"""Quantization throughput of the group-wise codec on a prefill's keys, and what it costs a prefill.

The prefill stores every prompt token's keys and values; with a compressed cache they are quantized
as they are stored, from the layer's (batch, heads, seq, head_dim) output into the cache's
slot-major layout. This times that quantization by the torch path at several block sizes (values
per block: fewer, larger blocks launch fewer kernels) and by the fused Triton kernel where there is
one, then a whole prefill with and without a compressed cache (the runtime's default path).

    python bench/quantize.py [--model opt-6.7b --batch 128]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexoff import LLM, Policy, TierFractions  # noqa: E402
from flexoff.compression import CompressedTensor, quantize, triton_available  # noqa: E402
from flexoff.runtime.kv_storage import SLOT_MAJOR  # noqa: E402
from flexoff.policy import CompressionConfig  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds_of(fn, repeats: int = 3) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def time_quantize(batch: int, heads: int, prompt_len: int, device: torch.device, dtype: torch.dtype) -> None:
    keys = torch.randn(batch, heads, prompt_len, 128, device=device, dtype=dtype)
    out = CompressedTensor.empty(SLOT_MAJOR.shape(prompt_len, batch, heads, 128), dtype, 4, 64, -1, device)
    print(f"quantize {tuple(keys.shape)} into the slot-major cache on {device}")
    for chunk in (1 << 22, 1 << 25, 1 << 27):
        seconds = seconds_of(lambda chunk=chunk: quantize(SLOT_MAJOR.arrange(keys), 4, 64, -1, out=out,
                                                          use_triton=False, chunk_elements=chunk))
        print(f"  torch, blocks of {chunk >> 20}M values: {seconds * 1e3:.1f} ms, "
              f"{keys.numel() / seconds / 1e9:.1f} G values/s")
    if device.type == "cuda" and triton_available():
        seconds = seconds_of(lambda: quantize(SLOT_MAJOR.arrange(keys), 4, 64, -1, out=out, use_triton=True))
        print(f"  Triton kernel: {seconds * 1e3:.1f} ms, {keys.numel() / seconds / 1e9:.1f} G values/s, "
              f"{keys.numel() * keys.element_size() / seconds / 1e9:.0f} GB/s read")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="opt-6.7b")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--heads", type=int, default=32)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    time_quantize(args.batch, args.heads, args.prompt_len, device, dtype)
    four_bit = CompressionConfig(4, 64)
    gpu = TierFractions(1, 0, 0)
    for compress in (None, four_bit):
        policy = Policy(args.batch, 1, gpu, gpu, gpu, compress_cache=compress)
        llm = LLM(args.model, dummy=True, policy=policy)
        prompts = [[100 + i % 500] * args.prompt_len for i in range(args.batch)]
        seconds = seconds_of(lambda llm=llm, prompts=prompts: llm.engine.last_logits(prompts), repeats=2)
        label = "4-bit cache" if compress else "fp16 cache"
        print(f"prefill of {args.batch} x {args.prompt_len} on {args.model}, {label}: {seconds:.2f} s, "
              f"{args.batch * args.prompt_len / seconds:.0f} token/s")
        llm.close()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
