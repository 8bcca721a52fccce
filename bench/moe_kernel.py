"""A sparse MLP's speed in prefill and decode, by how many tokens are routed together
(models.moe.chunk_tokens), with the steps around its grouped matmuls fused (Triton) and unfused.

One sparse layer of the model, random weights in the compute dtype on the device, ``--tokens``
random hidden states through ``moe.sparse_mlp`` at each chunk size. For scale: a dense matmul of the
same FLOPs (every pair's rows through one expert's matrices, the rate the issue's goal is against),
and the planner's rate for the rows an expert gets (``HardwareProfile.matmul_flops_at``). TFLOP/s
counts the active experts' FLOPs only (k of E experts a token).

    python bench/moe_kernel.py --model mixtral-8x7b --hardware h100
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
    parser.add_argument("--decode-tokens", default="16,64,320",
                        help="also time these few tokens at once, as a decode step's GPU batch")
    parser.add_argument("--hardware", help="a profile whose matmul curve to show beside the kernel")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true",
                        help="also time one call at the default chunk by operator, under torch.profiler")
    args = parser.parse_args()
    cfg = resolve_model_config(args.model)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    cuda = device.type == "cuda"
    w = layer_weights(cfg, dtype, device)
    k, experts = cfg.experts_per_token, cfg.num_experts
    active = active_flops_per_token(expert_shape(cfg))
    hw = resolve_hardware(args.hardware) if args.hardware else None
    fused = moe.fused_kernels(torch.empty(0, device=device, dtype=dtype)) is not None
    print(f"{args.model}: one sparse layer, {args.dtype} on {args.device}, {experts} experts, {k} a token; "
          f"TFLOP/s of the active experts; experts by {moe.expert_kernels(device, dtype)}")
    print("| tokens a call | chunk tokens | rows an expert | unfused ms | unfused TFLOP/s | fused ms | fused TFLOP/s "
          "| dense matmul TFLOP/s, same FLOPs | fused / dense | profile's rate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    default, chosen = moe.chunk_tokens, moe.chunk_tokens(cfg)
    shapes = [(args.tokens, int(c)) for c in args.chunks.split(",")]
    shapes += [(int(t), int(t)) for t in args.decode_tokens.split(",") if t]
    try:
        for tokens, chunk in shapes:
            moe.chunk_tokens = lambda _cfg, chunk=chunk: chunk
            x = torch.randn(1, tokens, cfg.hidden_size, device=device).to(dtype)
            flops = active * tokens
            grouped = median_seconds(lambda: moe.sparse_mlp(cfg, w, x, fused=False), args.repeats, cuda)
            fused_s = median_seconds(lambda: moe.sparse_mlp(cfg, w, x), args.repeats, cuda) if fused else None
            pairs = min(chunk, tokens) * k
            dense = _dense_seconds(cfg, pairs, dtype, device, args.repeats, cuda)
            dense_rate = active * pairs / k / dense
            rows = max(1, pairs // experts)
            profile = f"{hw.matmul_flops_at(rows) / 1e12:.0f}" if hw else "-"
            fused_cols = (f"{fused_s * 1e3:.3f} | {flops / fused_s / 1e12:.1f} | " if fused_s else "- | - | ")
            ratio = f"{flops / fused_s / dense_rate:.2f}" if fused_s else "-"
            print(f"| {tokens} | {chunk}{' (the default)' if chunk == chosen else ''} | {rows} | {grouped * 1e3:.3f} | "
                  f"{flops / grouped / 1e12:.1f} | {fused_cols}{dense_rate / 1e12:.1f} | {ratio} | {profile} |",
                  flush=True)
    finally:
        moe.chunk_tokens = default
    if args.profile:
        x = torch.randn(1, args.tokens, cfg.hidden_size, device=device).to(dtype)
        for name, fused_steps in (("unfused", False), ("fused", True)):
            if name == "unfused" or fused:
                print(f"\n{name}:")
                print_profile(lambda: moe.sparse_mlp(cfg, w, x, fused=fused_steps), cuda)


def _dense_seconds(cfg, pairs: int, dtype, device, repeats: int, cuda: bool) -> float:
    """Both expert matmuls of ``pairs`` rows through one expert's matrices: the dense rate."""
    hidden, width = cfg.hidden_size, cfg.expert_intermediate_size
    a = torch.randn(pairs, hidden, device=device).to(dtype)
    gate_up = torch.randn(hidden, 2 * width, device=device).to(dtype)
    inner = torch.randn(pairs, width, device=device).to(dtype)
    down = torch.randn(width, hidden, device=device).to(dtype)
    return median_seconds(lambda: (a @ gate_up, inner @ down), repeats, cuda)


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
