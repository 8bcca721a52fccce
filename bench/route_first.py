"""Route-first loading against loading every expert a stage ahead, by block size.

One model with its experts in CPU memory (4-bit with --compress), blocks of one GPU batch of N
sequences (N = 1, 2, 4, ... up to --max-rows), each run twice: with route-first loading forced on
and forced off. Prints decode token/s of each and the time route-first saves; the runtime keeps it
only where the experts the uniform estimate leaves untouched, less route-first's measured cost, are
at least 10% of them (``flexoff.layout.routes_first``).

    python bench/route_first.py --model mixtral-8x7b --compress --max-rows 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexoff import LLM, Policy, SamplingParams, TierFractions  # noqa: E402
from flexoff.layout import routes_first  # noqa: E402
from flexoff.policy import CompressionConfig  # noqa: E402
from flexoff.runtime import weight_store  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mixtral-8x7b")
    parser.add_argument("--compress", action="store_true", help="4-bit weights")
    parser.add_argument("--max-rows", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=8)
    parser.add_argument("--offload-dir", default="/tmp")
    args = parser.parse_args()
    on_cpu = TierFractions(0, 1, 0)
    policy = Policy(args.max_rows, 1, on_cpu, TierFractions(1, 0, 0), TierFractions(1, 0, 0),
                    compress_weight=CompressionConfig(4, 64) if args.compress else None)
    llm = LLM(args.model, dummy=True, policy=policy, offload_dir=args.offload_dir)
    params = SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True)
    print(f"{args.model}, experts in CPU memory{', 4-bit' if args.compress else ''}, prompt {args.prompt_len}, "
          f"generate {args.gen_len}; decode token/s")
    print("| rows | all experts ahead | route first | time saved | layout.routes_first |")
    print("|---|---|---|---|---|")
    rows = 1
    while rows <= args.max_rows:
        prompts = [[100 + (i * 7 + j) % 900 for j in range(args.prompt_len)] for i in range(rows)]
        rates = {}
        for forced in (False, True):
            weight_store.routes_first = lambda *_, forced=forced: forced
            llm.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
            rates[forced] = llm.generate(prompts, params).metrics.decode_throughput
        saved = 1 - rates[False] / rates[True]
        print(f"| {rows} | {rates[False]:.2f} | {rates[True]:.2f} | {saved:.1%} | "
              f"{routes_first(llm.config, rows, 1)} |")
        rows *= 2
    llm.close()


if __name__ == "__main__":
    main()
