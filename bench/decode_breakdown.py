"""Where a policy's decode time goes: a torch.profiler trace of a short run, next to the time a plain
copy of the same off-GPU weight bytes takes.

    python bench/decode_breakdown.py --model opt-6.7b --percent 50 50 100 0 100 0 --gpu-batch-size 48
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexoff import LLM, Policy, SamplingParams  # noqa: E402
from flexoff.policy import CompressionConfig, placement_from_percent  # noqa: E402


def copy_bandwidth(num_bytes: int) -> float:
    """GB/s of one pinned host-to-GPU copy of ``num_bytes``."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return num_bytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="opt-6.7b")
    parser.add_argument("--percent", type=float, nargs=6, default=[50, 50, 100, 0, 100, 0])
    parser.add_argument("--gpu-batch-size", type=int, default=48)
    parser.add_argument("--num-gpu-batches", type=int, default=1)
    parser.add_argument("--cpu-attention", action="store_true")
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--compress-weight", action="store_true", help="4-bit weights, groups of 64")
    parser.add_argument("--compress-cache", action="store_true", help="4-bit KV cache, groups of 64")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=8)
    parser.add_argument("--offload-dir", default="/tmp")
    parser.add_argument("--trace", default="/tmp/flexoff-trace.json", help="where to write the chrome trace")
    args = parser.parse_args()
    policy = Policy(gpu_batch_size=args.gpu_batch_size, num_gpu_batches=args.num_gpu_batches,
                    **placement_from_percent(args.percent), cpu_attention=args.cpu_attention,
                    overlap=not args.no_overlap,
                    compress_weight=CompressionConfig(4, 64) if args.compress_weight else None,
                    compress_cache=CompressionConfig(4, 64) if args.compress_cache else None)
    llm = LLM(args.model, dummy=True, policy=policy, offload_dir=args.offload_dir)
    streamed = llm.engine.weights.bytes["cpu"]
    if streamed:
        print(f"streamed weight bytes per step: {streamed / 1e9:.2f} GB; pinned copy "
              f"{copy_bandwidth(min(streamed, 4 << 30)):.1f} GB/s")
    prompts = [[100 + i % 500] * args.prompt_len for i in range(policy.block_size)]
    params = SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True)
    llm.generate([q[:32] for q in prompts], SamplingParams(max_new_tokens=2, ignore_eos=True))
    result = llm.generate(prompts, params)
    m = result.metrics
    print(f"prefill {m.prefill_throughput:.0f} tok/s, decode {m.decode_throughput:.1f} tok/s "
          f"({m.decode_time / max(1, args.gen_len - 1) * 1000:.1f} ms/step)")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    trace = Path(args.trace)
    prof.export_chrome_trace(str(trace))
    gpu_gaps(trace)
    llm.close()


def gpu_gaps(trace: Path) -> None:
    """Busy time per stream and the largest idle gaps of the GPU as a whole, from a chrome trace."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"])
    if not events:
        return
    busy: dict = {}
    for e in events:
        busy[e["tid"]] = busy.get(e["tid"], 0) + e["dur"]
    span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
    print(f"GPU span {span / 1e3:.1f} ms; busy per stream (ms): "
          + ", ".join(f"{tid}: {us / 1e3:.1f}" for tid, us in busy.items()))
    gaps, end, last = [], events[0]["ts"], events[0]
    for e in events:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, last["name"][:50], e["name"][:50]))
        if e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    gaps.sort(reverse=True)
    print(f"GPU idle total {sum(g[0] for g in gaps) / 1e3:.1f} ms in {len(gaps)} gaps; largest:")
    for gap, before, after in gaps[:15]:
        print(f"  {gap / 1e3:8.2f} ms  after {before!r}  before {after!r}")


if __name__ == "__main__":
    main()
