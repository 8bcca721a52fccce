"""Where a shared prefix's decode step spends its time: one few-shot job through ``LLM.generate``
with sharing on and off at one policy, each arm's prefill and decode time, and with ``--profile``
the CUDA kernels and host calls of the shared arm's decode, largest first.

    python bench/shared_prefix_steps.py --model opt-6.7b --percent 100 0 0 100 100 0 [--profile]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexoff import LLM, Policy, SamplingParams  # noqa: E402
from flexoff.policy import placement_from_percent  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-6.7b")
    parser.add_argument("--percent", type=float, nargs=6, default=[100, 0, 0, 100, 100, 0])
    parser.add_argument("--gpu-batch-size", type=int, default=20)
    parser.add_argument("--num-gpu-batches", type=int, default=2)
    parser.add_argument("--subjects", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = []
    for _ in range(args.subjects):
        head = [rng.randrange(4, 50000) for _ in range(480)]
        prompts += [{"prompt_token_ids": head + [rng.randrange(4, 50000) for _ in range(rng.randint(40, 120))]}
                    for _ in range(12)]
    policy = Policy(gpu_batch_size=args.gpu_batch_size, num_gpu_batches=args.num_gpu_batches,
                    **placement_from_percent(args.percent))
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    for share in (False, True):
        with LLM(args.model, dummy=True, policy=policy, prefix_sharing=share) as llm:
            llm.generate(prompts[:args.gpu_batch_size], SamplingParams(max_tokens=2, ignore_eos=True))  # warm
            start = time.perf_counter()
            if args.profile and share:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    result = llm.generate(prompts, params)
            else:
                result = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            m = result.metrics
            print(f"sharing {share}: wall {wall:.2f} s, prefill {m.prefill_time:.2f} s, decode {m.decode_time:.2f} s, "
                  f"prompt {m.prompt_tokens} / {m.padded_prompt_tokens} padded, {m.shared_prompt_tokens} shared",
                  flush=True)
    if args.profile:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
