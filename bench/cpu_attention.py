"""Decode attention on the CPU over a cache in host memory: which formulation streams keys fastest,
and, for a 4-bit compressed cache, CPU attention in place against shipping it to the GPU.

One decode step of one layer for a GPU batch of OPT-30B shape by default (32 sequences, 56 heads,
544 cached tokens, head_dim 128), in the cache's dtype. The first table gives GB/s of cache read
by plain CPU attention formulations. The second compares, for the same shape compressed 4-bit
group 64 along head_dim (the runtime's KV format):

- CPU: ``flexoff.runtime.kv.cpu_attention`` reading the compressed cache the way the runtime does
  (each chunk of sequences decompressed by ``QuantizedFormat.decode``), plus its parts;
- GPU (CUDA only): copy the compressed cache (codes, scales, minimums) from pinned memory,
  dequantize with the Triton kernel, attend on the GPU; plus the PCIe copy alone.

GB/s are of the fp16-equivalent cache (keys + values) and of the compressed bytes.

    python bench/cpu_attention.py --rows 32 --heads 56 --tokens 544
    python bench/cpu_attention.py --quick            # small sizes: under a minute on 2 cores
    python bench/cpu_attention.py --compressed-only
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import median_seconds
from flexoff.compression import CompressedTensor, compressed_nbytes, dequantize
from flexoff.models.common import attention
from flexoff.runtime.kv import cpu_attention
from flexoff.runtime.kv_storage import ROW_MAJOR, QuantizedFormat
from flexoff.policy import CompressionConfig


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


def plain_table(args) -> None:
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
            print(f"{dtype!s:15s} {name:20s} {seconds * 1e3:8.2f} ms  {cache_bytes / seconds / 1e9:7.1f} GB/s"
                  f"  max err {error:.1e}")


def compressed_table(args) -> None:
    """CPU attention over a 4-bit cache in place vs PCIe + Triton dequantize + GPU attention."""
    dtype = torch.float16
    shape = (args.rows, args.heads, args.tokens, args.head_dim)
    # The runtime's CPU cache: row-major (rows, kv_heads, slots, head_dim) with room for more
    # tokens, so a step reads a narrowed (strided) view of its first `tokens` slots.
    slots = args.tokens + 32
    fmt = QuantizedFormat(CompressionConfig(bits=args.bits, group_size=args.group_size), dtype)
    k, v = (torch.randn(shape, dtype=dtype) for _ in range(2))
    q = torch.randn(args.rows, args.heads, 1, args.head_dim, dtype=dtype)
    mask = torch.ones(args.rows, 1, 1, args.tokens, dtype=torch.bool)
    mask[:, :, :, :7] = False
    cache = []
    for x in (k, v):
        buffer = fmt.empty(ROW_MAJOR.shape(slots, *shape[:2], args.head_dim),
                            lambda size, dt: torch.empty(size, dtype=dt))
        ROW_MAJOR.write(fmt, buffer, 0, x)
        cache.append(buffer)
    fp16_bytes = 2 * k.numel() * k.element_size()
    packed_bytes = 2 * compressed_nbytes(shape, args.bits, args.group_size, -1, dtype)
    read = [partial(ROW_MAJOR.read, fmt, buffer, args.tokens) for buffer in cache]
    rows_ = []

    def row(name, seconds, where):
        rows_.append((name, seconds, where))

    row("CPU attention, plain fp16 cache (kv.cpu_attention)",
        median_seconds(lambda: cpu_attention(q, lambda r: k[r], lambda r: v[r], mask), args.repeat), "cpu")
    cpu_step = median_seconds(lambda: cpu_attention(q, read[0], read[1], mask), args.repeat)
    row(f"CPU attention, {args.bits}-bit cache (kv.cpu_attention, decompress per chunk)", cpu_step, "cpu")
    row(f"  of which: CPU dequantize {args.bits}-bit -> fp16 (keys + values)",
        median_seconds(lambda: [fn(slice(0, args.rows)) for fn in read], args.repeat), "cpu")
    # The runtime decodes into a fresh tensor each call (page faults on a large one); into a
    # reused buffer shows the codec's own speed.
    reused = [torch.empty(shape, dtype=dtype) for _ in range(2)]
    row(f"  CPU dequantize {args.bits}-bit -> fp16 into reused buffers (not what the runtime does)",
        median_seconds(lambda: [dequantize(buffer.narrow(2, 0, args.tokens), out=out)
                                  for buffer, out in zip(cache, reused)], args.repeat), "cpu")
    gpu_step = None
    if torch.cuda.is_available():
        device = torch.device("cuda")
        # What travels: the first `tokens` slots of each part, contiguous (as a slot-major cache's are).
        host = [part.contiguous().pin_memory() for buffer in cache for part in fmt.parts(buffer.narrow(2, 0, args.tokens))]
        landing = [torch.empty_like(part, device=device) for part in host]
        compressed = [CompressedTensor(*landing[i:i + 3], shape, dtype, -1, args.bits, args.group_size)
                      for i in (0, 3)]
        decoded = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)]
        q_gpu, mask_gpu = q.to(device), mask.to(device)

        def copy():
            for target, source in zip(landing, host):
                target.copy_(source, non_blocking=True)

        def decode_and_attend():
            for ct, out in zip(compressed, decoded):
                dequantize(ct, out=out)
            return attention(q_gpu, decoded[0], decoded[1], mask_gpu)

        def whole():
            copy()
            return decode_and_attend()

        expected = cpu_attention(q, read[0], read[1], mask).float()
        error = (whole().cpu().float() - expected).abs().max().item()
        row("GPU: PCIe copy of the compressed cache (pinned -> GPU)",
            median_seconds(copy, args.repeat, cuda=True), "gpu")
        row(f"GPU: Triton dequantize + attention (max diff vs CPU {error:.1e})",
            median_seconds(decode_and_attend, args.repeat, cuda=True), "gpu")
        gpu_step = median_seconds(whole, args.repeat, cuda=True)
        row("GPU: copy + dequantize + attention, one after another", gpu_step, "gpu")

    print(f"\n{args.rows} sequences x {args.heads} heads x {args.tokens} keys x {args.head_dim}, {args.bits}-bit "
          f"group {args.group_size}: fp16 cache {fp16_bytes / 1e6:.0f} MB, compressed {packed_bytes / 1e6:.0f} MB "
          f"(CPU: {torch.get_num_threads()} threads"
          + (f"; GPU: {torch.cuda.get_device_name()})" if torch.cuda.is_available() else "; no CUDA)") + "\n")
    print("| path | ms per step | GB/s fp16-equivalent | GB/s compressed |")
    print("|---|---:|---:|---:|")
    for name, seconds, _ in rows_:
        print(f"| {name} | {seconds * 1e3:.2f} | {fp16_bytes / seconds / 1e9:.1f} | {packed_bytes / seconds / 1e9:.1f} |")
    print()
    if gpu_step is None:
        estimate = packed_bytes / (args.pcie_gbps * 1e9)
        print(f"No CUDA: the GPU path was not measured. At an assumed {args.pcie_gbps:g} GB/s of compressed bytes "
              f"the PCIe copy alone would take {estimate * 1e3:.2f} ms, {cpu_step / estimate:.1f}x less than the "
              f"{cpu_step * 1e3:.2f} ms of CPU attention over the compressed cache (estimate, not a measurement).")
    elif gpu_step < cpu_step:
        print(f"Per decode step, shipping the compressed cache and attending on the GPU ({gpu_step * 1e3:.2f} ms) "
              f"is {cpu_step / gpu_step:.1f}x faster than CPU attention over it ({cpu_step * 1e3:.2f} ms).")
    else:
        print(f"Per decode step, CPU attention over the compressed cache ({cpu_step * 1e3:.2f} ms) is "
              f"{gpu_step / cpu_step:.1f}x faster than shipping it to the GPU ({gpu_step * 1e3:.2f} ms).")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=None, help="sequences (default 32; 4 with --quick)")
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--tokens", type=int, default=544)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=None, help="timed calls (default 5; 2 with --quick)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--pcie-gbps", type=float, default=55.0,
                        help="without CUDA: assumed host-to-GPU GB/s for the estimate line")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--compressed-only", action="store_true", help="skip the plain formulations table")
    args = parser.parse_args()
    args.rows = args.rows or (4 if args.quick else 32)
    args.repeat = args.repeat or (2 if args.quick else 5)
    print(f"threads {torch.get_num_threads()}")
    if not args.compressed_only:
        plain_table(args)
    compressed_table(args)


if __name__ == "__main__":
    main()
