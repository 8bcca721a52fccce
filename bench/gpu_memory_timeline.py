"""Where a run's GPU memory peaks: CUDA's allocator peak within every step of the block schedule,
beside what the layout counts for the policy, part by part.

Every step the engine takes (schedule.py) is bracketed: the memory allocated when it starts, and
the allocator's peak until the next step starts. The report names the step where the run peaks
(kind, token, stage, GPU batch), how much was allocated as it began and how much it added, the
steps that peak highest, the highest peak of the prefill and of decode, and the layout's figure
for each part of the block (``layout.block_gpu_parts``) and for the weights.

    python bench/gpu_memory_timeline.py --model opt-30b --policy auto --compress auto --hardware h100 --gpu-mem 24GiB
    python bench/gpu_memory_timeline.py --model opt-66b --policy-file policy.json --gen-len 2 --json steps.json

The allocator's peak is reset at every step, so the run's own peak figure is not reported: the
largest step peak is the run's peak.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_policy import add_policy_args, cuda_job  # noqa: E402
from flexoff import LLM, SamplingParams  # noqa: E402
from flexoff.layout import block_gpu_parts, weight_bytes  # noqa: E402
from flexoff.planner.cost_model import CostModel, Workload  # noqa: E402
from flexoff.planner.report import policy_summary  # noqa: E402
from flexoff.runtime.schedule import SYNC  # noqa: E402

GiB = 1 << 30


class MemoryTrace:
    """The engine's observer: the allocated memory as each step starts and the peak until the next."""

    def __init__(self):
        self.steps: list[dict] = []
        self._open: dict | None = None

    def __call__(self, step) -> None:
        if self._open is not None:
            self._open["peak"] = torch.cuda.max_memory_allocated()
            self._open["reserved"] = torch.cuda.max_memory_reserved()
            self._open["after"] = torch.cuda.memory_allocated()
            self.steps.append(self._open)
            self._open = None
        if step.kind == SYNC:
            return
        torch.cuda.reset_peak_memory_stats()
        self._open = {"kind": step.kind, "token": step.token, "stage": step.stage, "batch": step.batch,
                      "before": torch.cuda.memory_allocated()}


def _where(step: dict) -> str:
    return f"{step['kind']} token {step['token']} stage {step['stage']} batch {step['batch']}"


def report(steps: list[dict], parts: dict[str, int], weights_gpu: int, before_run: int, top: int) -> dict:
    """Print the peak, its step, the highest steps and the layout's parts; return them as data."""
    peak = max(steps, key=lambda s: s["peak"])
    predicted = weights_gpu + sum(parts.values())
    print(f"\nallocated before the run (weights and buffers the engine keeps): {before_run / GiB:.2f} GiB")
    print(f"run peak: {peak['peak'] / GiB:.2f} GiB at {_where(peak)}: {peak['before'] / GiB:.2f} GiB allocated "
          f"as it began, +{(peak['peak'] - peak['before']) / GiB:.2f} GiB within it")
    print(f"layout: {predicted / GiB:.2f} GiB ({(peak['peak'] - predicted) / predicted:+.1%} measured against it)")
    reserved = max(s.get("reserved", 0) for s in steps)
    if reserved:
        # Freed blocks a side stream still reads stay reserved: the card's real need.
        print(f"reserved by the allocator at most: {reserved / GiB:.2f} GiB "
              f"({(reserved - predicted) / predicted:+.1%} against the layout)")
    print("\n| part (layout) | GiB |\n| --- | --- |")
    print(f"| weights and their buffers | {weights_gpu / GiB:.2f} |")
    for name, nbytes in parts.items():
        print(f"| {name} | {nbytes / GiB:.2f} |")
    print("\n| highest steps | peak GiB | allocated at start | added within |\n| --- | --- | --- | --- |")
    for step in sorted(steps, key=lambda s: -s["peak"])[:top]:
        print(f"| {_where(step)} | {step['peak'] / GiB:.2f} | {step['before'] / GiB:.2f} | "
              f"{(step['peak'] - step['before']) / GiB:.2f} |")
    phases = {}
    for name, chosen in (("prefill", [s for s in steps if s["token"] == 0]),
                         ("decode", [s for s in steps if s["token"] > 0])):
        if chosen:
            phases[name] = max(chosen, key=lambda s: s["peak"])
            print(f"{name}: highest step {_where(phases[name])}, {phases[name]['peak'] / GiB:.2f} GiB")
    return {"peak": peak, "reserved": reserved, "predicted": predicted, "weights_gpu": weights_gpu, "parts": parts,
            "before_run": before_run, "phases": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_policy_args(parser)
    parser.add_argument("--gen-len", type=int, default=2)
    parser.add_argument("--top", type=int, default=8, help="highest steps to list")
    parser.add_argument("--json", help="write every step and the summary here")
    args = parser.parse_args()
    config, hardware, policy, num_prompts = cuda_job(args, "gpu_memory_timeline needs CUDA (the peaks are CUDA's "
                                                           "allocator's)")
    print(f"policy: {policy_summary(policy)}; {torch.cuda.get_device_name()}")
    predicted = CostModel(config, Workload(args.prompt_len, args.gen_len, num_prompts), hardware).predict(policy)
    print(f"the planner's GPU peak: {predicted.peak_memory['gpu'] / GiB:.2f} GiB")
    llm = LLM(args.model, dummy=True, policy=policy, offload_dir=args.offload_dir, gpu_mem=args.gpu_mem,
              cpu_mem=args.cpu_mem)
    try:
        prompts = [[100 + (i + j) % 500 for j in range(args.prompt_len)] for i in range(num_prompts)]
        llm.generate(prompts[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))  # kernels chosen, caches made
        torch.cuda.synchronize()
        before_run = torch.cuda.memory_allocated()
        trace = MemoryTrace()
        llm.engine.observer = trace
        llm.generate(prompts, SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True))
    finally:
        llm.close()
    parts = block_gpu_parts(config, policy, args.prompt_len, args.gen_len, llm.dtype.itemsize)
    weights_gpu = weight_bytes(config, policy, llm.dtype, policy.pin_cpu_memory)["gpu"]
    summary = report(trace.steps, parts, weights_gpu, before_run, args.top)
    if args.json:
        Path(args.json).write_text(json.dumps({"policy": policy.to_dict(), "steps": trace.steps, **summary}, indent=1))


if __name__ == "__main__":
    main()
