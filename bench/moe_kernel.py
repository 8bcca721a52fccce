"""A sparse MLP's speed in prefill, by how many tokens are routed together (models.moe.chunk_tokens).

One sparse layer of the model, random weights in the compute dtype on the device, ``--tokens``
random hidden states through ``moe.sparse_mlp`` at each chunk size; and, for scale, a dense matmul
of the same FLOPs at the rows an expert gets in one chunk, and the planner's rate for those rows
(``HardwareProfile.matmul_flops_at``), so prefill's over-prediction can be traced to the kernel.
TFLOP/s counts the active experts' FLOPs only (k of E experts a token).

    python bench/moe_kernel.py --model mixtral-8x7b --device cuda --hardware h100
    python bench/moe_kernel.py --model qwen3-30b-a3b --device cpu --tokens 512 --chunks 128,256,512
    python bench/moe_kernel.py --model qwen3-30b-a3b --profile   # where a call's time goes, by kernel
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import median_seconds  # noqa: E402

from flexoff.models import moe  # noqa: E402
from flexoff.models.registry import resolve_model_config  # noqa: E402
from flexoff.planner.hardware import resolve_hardware  # noqa: E402
from flexoff.planner.sparse_rate import active_flops_per_token, expert_shape  # noqa: E402
from flexoff.profiler.sparse_kernel import layer_weights  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mixtral-8x7b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--tokens", type=int, default=16384, help="tokens through the layer per call")
    parser.add_argument("--chunks", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--hardware", help="a profile whose matmul curve to show beside the kernel")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true",
                        help="also time one call at the default chunk by operator, under torch.profiler")
    args = parser.parse_args()
    cfg = resolve_model_config(args.model)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    cuda = device.type == "cuda"
    w = layer_weights(cfg, dtype, device)
    x = torch.randn(1, args.tokens, cfg.hidden_size, device=device).to(dtype)
    k, experts = cfg.experts_per_token, cfg.num_experts
    active = active_flops_per_token(expert_shape(cfg))
    hw = resolve_hardware(args.hardware) if args.hardware else None
    print(f"{args.model}: one sparse layer, {args.tokens} tokens, {args.dtype} on {args.device}, "
          f"{experts} experts, {k} a token; TFLOP/s of the active experts")
    print("| chunk tokens | rows an expert | ms | TFLOP/s | dense matmul TFLOP/s at those rows | profile's rate |")
    print("|---|---|---|---|---|---|")
    default, chosen = moe.chunk_tokens, moe.chunk_tokens(cfg)
    try:
        for chunk in (int(c) for c in args.chunks.split(",")):
            moe.chunk_tokens = lambda _cfg, chunk=chunk: chunk
            seconds = median_seconds(lambda: moe.sparse_mlp(cfg, w, x), args.repeats, cuda)
            rows = max(1, min(chunk, args.tokens) * k // experts)
            a = torch.randn(rows, cfg.hidden_size, device=device).to(dtype)
            b = torch.randn(cfg.hidden_size, 2 * cfg.expert_intermediate_size, device=device).to(dtype)
            dense = median_seconds(lambda: a @ b, args.repeats, cuda)
            dense_rate = 2 * rows * b.numel() / dense / 1e12
            profile = f"{hw.matmul_flops_at(rows) / 1e12:.0f}" if hw else "-"
            print(f"| {chunk}{' (the default)' if chunk == chosen else ''} | {rows} | {seconds * 1e3:.2f} | {active * args.tokens / seconds / 1e12:.1f} | "
                  f"{dense_rate:.1f} | {profile} |", flush=True)
    finally:
        moe.chunk_tokens = default
    if args.profile:
        print_profile(lambda: moe.sparse_mlp(cfg, w, x), cuda)


def print_profile(call, cuda: bool) -> None:
    """The operators of one call (after a warm one) by their device time, largest first."""
    from torch.profiler import ProfilerActivity, profile
    call()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        call()
        if cuda:
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
