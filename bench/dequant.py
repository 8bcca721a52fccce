"""Dequantization throughput of the group-wise codec, in GB/s of fp16 output.

On CUDA it times the plain torch path and the fused Triton kernel; on the CPU, the torch path.
Tensors are weight-sized by default (7168 x 28672, grouped along either dimension) plus a
KV-cache-shaped one grouped along head_dim.

    python bench/dequant.py                       # CUDA if present, else CPU
    python bench/dequant.py --device cpu --repeats 3
    python bench/dequant.py --shape 4096x4096:0 --bits 4 --json results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import median_seconds  # noqa: E402
from flexoff.compression import dequantize, quantize, triton_available  # noqa: E402

# (shape, grouped dim, what it stands for)
DEFAULT_CASES = [
    ((7168, 28672), 0, "weight, grouped along outputs"),
    ((7168, 28672), 1, "weight, grouped along inputs"),
    ((32, 8, 2048, 128), 3, "KV (batch, kv_heads, seq, head_dim)"),
]


def parse_case(text: str):
    """``AxBxC:dim`` -> ((A, B, C), dim, text)."""
    shape_text, _, dim_text = text.partition(":")
    shape = tuple(int(s) for s in shape_text.lower().split("x"))
    return shape, int(dim_text) if dim_text else len(shape) - 1, text


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--shape", action="append", type=parse_case, help="AxB[:dim], repeatable")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per path (default 20 on CUDA, 3 on CPU)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    repeats = args.repeats or (20 if device.type == "cuda" else 3)
    warmup = 3 if device.type == "cuda" else 1
    cases = args.shape or DEFAULT_CASES
    paths = [("torch", False)]
    if device.type == "cuda" and args.bits == 4 and triton_available():
        paths.append(("triton", True))

    print(f"device: {device_name(device)}; torch {torch.__version__}; {args.bits}-bit, group {args.group_size}")
    header = f"{'shape':>20} {'dim':>3} {'path':>7} {'ms':>9} {'GB/s out':>9} {'GB/s in':>8}  case"
    print(header)
    print("-" * len(header))
    rows = []
    for shape, dim, label in cases:
        generator = torch.Generator(device=device).manual_seed(0)
        weight = torch.randn(shape, generator=generator, device=device, dtype=torch.float16)
        ct = quantize(weight, args.bits, args.group_size, dim)
        del weight
        out = torch.empty(shape, dtype=torch.float16, device=device)
        for path, use_triton in paths:
            def run(ct=ct, out=out, use_triton=use_triton):
                dequantize(ct, out=out, use_triton=use_triton)

            seconds = median_seconds(run, repeats, cuda=device.type == "cuda", warmup=warmup)
            out_gbs = out.numel() * out.element_size() / seconds / 1e9
            in_gbs = ct.nbytes / seconds / 1e9
            shape_text = "x".join(map(str, shape))
            print(f"{shape_text:>20} {dim:>3} {path:>7} {seconds * 1e3:9.2f} {out_gbs:9.1f} {in_gbs:8.1f}  {label}")
            rows.append(
                {
                    "device": device_name(device), "shape": list(shape), "dim": dim, "bits": args.bits,
                    "group_size": args.group_size, "path": path, "ms": seconds * 1e3,
                    "out_gb_per_s": out_gbs, "in_gb_per_s": in_gbs,
                }
            )
        del ct, out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
