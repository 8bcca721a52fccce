"""The prefill of jobs whose GPU batches pad, with the packed prefill (runtime.packed_prefill) and
without it, in one process: one LLM, the arms taking turns so that neither has the warmer machine.

Shapes, from bench/shared_prefix.py: ``mmlu``, its 5-shot job (subjects of 12 questions behind a
shared prefix: the rows' own parts pad), shared; ``choices``, its multiple-choice job (contexts of
300-500 tokens with 4 continuations each: the prefixes pad too), shared; ``ragged``, prompts of 64-512 tokens in one
block, unshared, as a fixed policy's GPU batch meets them. Each arm's prefill seconds, the
positions its layers computed, and the ratio are printed as one JSON line per shape.

    python bench/packed_prefill.py --model opt-30b --gpu-mem 16GiB --hardware h200 --offload-dir /tmp/off
    python bench/packed_prefill.py --model opt-125m --device cpu --subjects 8 --policy "24 2"
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shared_prefix  # noqa: E402  (the shapes, from the script beside this one)
from flexoff import LLM, Policy, SamplingParams  # noqa: E402
from flexoff.planner.report import policy_summary  # noqa: E402
from flexoff.runtime import packed_prefill  # noqa: E402


def drawing(vocab: int, scale: float):
    """``draw(rng, count)`` for the shapes of bench/shared_prefix.py: ids below the model's
    vocabulary (and its first special ids), every length times ``scale`` (a small model's few
    positions)."""
    low, high = min(100, vocab // 4), min(30000, vocab)

    def draw(rng: random.Random, count: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(max(1, round(count * scale)))]

    return draw


def mmlu(rng: random.Random, subjects: int, draw) -> list[list[int]]:
    return shared_prefix.mmlu_prompts(rng, subjects, draw)


def choices(rng: random.Random, subjects: int, draw) -> list[list[int]]:
    prompts, continuations = shared_prefix.choice_prompts(rng, subjects * 3, draw)
    return [p + c for p, c in zip(prompts, continuations)]


def ragged(rng: random.Random, subjects: int, draw) -> list[list[int]]:
    return [draw(rng, rng.randint(64, 512)) for _ in range(subjects * 12)]


SHAPES = {"mmlu": (mmlu, True), "choices": (choices, True), "ragged": (ragged, False)}


def arm(llm: LLM, prompts, packed: bool) -> dict:
    """One pass of the job's prefill (one new token each), packed or padded."""
    saved = packed_prefill.MIN_PADDING_SHARE
    if not packed:
        packed_prefill.MIN_PADDING_SHARE = 2.0  # no batch pads more than all its positions
    made = []
    real_init = packed_prefill.PackedPrefill.__init__

    def counting(self, lengths, width, device):
        real_init(self, lengths, width, device)
        made.append(len(lengths) * width - sum(lengths))  # the padded positions it skips

    packed_prefill.PackedPrefill.__init__ = counting
    try:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, ignore_eos=True))
        wall = time.perf_counter() - start
    finally:
        packed_prefill.PackedPrefill.__init__ = real_init
        packed_prefill.MIN_PADDING_SHARE = saved
    metrics = outs.metrics
    return {"prefill_s": round(metrics.prefill_time, 3), "wall_s": round(wall, 3),
            "layout_positions": metrics.padded_prompt_tokens,
            "computed_positions": metrics.padded_prompt_tokens - sum(made),
            "tokens": [o.token_ids for o in outs]}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="opt-30b", help="a registry name or a checkpoint directory (dummy weights)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gpu-mem", default=None)
    parser.add_argument("--policy", default="auto",
                        help="'auto' (planned for each shape's job, --compress auto) or a GPU batch size and "
                             "batches, e.g. '80 3', every tier the GPU")
    parser.add_argument("--hardware", default=None, help="the profile --policy auto plans on")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--subjects", type=int, default=19, help="the job's size: subjects of 12 prompts")
    parser.add_argument("--rounds", type=int, default=2, help="turns each arm takes")
    parser.add_argument("--scale", type=float, default=1.0, help="every prompt length times this")
    parser.add_argument("--offload-dir", default=None)
    args = parser.parse_args(argv)
    from flexoff.models.registry import resolve_model_config
    from flexoff.prompts import prompt_workload

    extra = {k: v for k, v in (("gpu_mem", args.gpu_mem), ("offload_dir", args.offload_dir)) if v}
    rows = []
    for shape in args.shapes:
        make, share = SHAPES[shape]
        draw = drawing(resolve_model_config(args.model).vocab_size, args.scale)
        prompts = make(random.Random(0), args.subjects, draw)
        if args.policy == "auto":
            workload = prompt_workload(prompts, [1] * len(prompts), args.model, None, share=share)
            planned = dict(policy="auto", workload=workload, hardware=args.hardware, compress="auto")
        else:
            size, batches = (int(x) for x in args.policy.split())
            planned = dict(policy=Policy(size, batches))
        with LLM(args.model, dummy=True, device=args.device, dtype=args.dtype, prefix_sharing=share,
                 **planned, **extra) as llm:
            policy = llm.policy
            runs = {True: [], False: []}
            for _ in range(args.rounds):
                for packed in (True, False):
                    runs[packed].append(arm(llm, prompts, packed))
        best = {packed: min(r["prefill_s"] for r in rs) for packed, rs in runs.items()}
        same = all(r["tokens"] == runs[True][0]["tokens"] for rs in runs.values() for r in rs)
        rows.append({
            "shape": shape, "model": args.model, "policy": policy_summary(policy), "prompts": len(prompts),
            "prefill_s": {"packed": [r["prefill_s"] for r in runs[True]],
                          "padded": [r["prefill_s"] for r in runs[False]]},
            "positions": {"padded": runs[False][0]["computed_positions"],
                          "packed": runs[True][0]["computed_positions"]},
            "padded_over_packed": round(best[False] / best[True], 3), "same_tokens": same})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
