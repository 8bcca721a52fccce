"""One block of the MMLU-shaped job (``bench/shared_prefix.py``'s), sharing on then off, each arm
planned for its own job: a first block, then a second under ``torch.profiler``, to tell the GPU's
kernel time from the block's wall time and the first block's extra time from the rest.

    python bench/shared_prefix_profile.py --model opt-30b --gpu-mem 16GiB --hardware h200 > profile.txt
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared_prefix import mmlu_prompts  # noqa: E402


def profile_arm(args, prompts: list[list[int]], share: bool) -> None:
    import torch

    from flexoff import LLM, SamplingParams
    from flexoff.prompts import prompt_workload

    workload = prompt_workload(prompts, [4] * len(prompts), args.model, None, share=share)
    with LLM(args.model, dummy=True, policy="auto", gpu_mem=args.gpu_mem, compress=args.compress,
             workload=workload, hardware=args.hardware, offload_dir=args.offload_dir, prefix_sharing=share) as llm:
        size = llm.policy.block_size
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        first = llm.generate(prompts[:size], params).metrics
        print(f"sharing {'on' if share else 'off'}: {llm.policy.gpu_batch_size}x{llm.policy.num_gpu_batches}; "
              f"first block prefill {first.prefill_time:.3f} s, decode {first.decode_time:.3f} s", flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            second = llm.generate(prompts[size:2 * size], params).metrics
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        copies = sum(e.self_device_time_total for e in events if e.key.startswith("Memcpy")) / 1e6
        kernels = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.key.startswith("Memcpy")) / 1e6
        print(f"  second block (profiled) prefill {second.prefill_time:.3f} s, decode {second.decode_time:.3f} s, "
              f"wall {wall:.3f} s; GPU kernels {kernels:.3f} s, copies {copies:.3f} s")
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-30b")
    parser.add_argument("--gpu-mem", default="16GiB")
    parser.add_argument("--compress", default="auto")
    parser.add_argument("--hardware", default=None)
    parser.add_argument("--subjects", type=int, default=57)
    parser.add_argument("--offload-dir", default="/tmp")
    parser.add_argument("--rows", type=int, default=22, help="kernels listed per arm")
    args = parser.parse_args(argv)
    prompts = mmlu_prompts(random.Random(0), args.subjects)
    for share in (True, False):
        profile_arm(args, prompts, share)


if __name__ == "__main__":
    main()
