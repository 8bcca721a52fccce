"""Shared prefixes on and off, in one run: the jobs whose prompts repeat a prefix.

Shapes (token-id prompts drawn from a seeded generator, so nothing is tokenized or downloaded):

- ``mmlu``: 57 subjects (``--subjects``), each a 480-token prefix of in-context examples shared
  by its 12 questions, a 40-120-token question of its own, 4 new tokens each (684 prompts);
- ``chat``: 240 requests behind one 300-token system prompt, 20-200 tokens of their own, 32-128
  new tokens each;
- ``choices``: an lm-eval-shaped multiple-choice job, 200 contexts of 300-500 tokens with four
  continuations of 1-8 tokens each, scored through ``LLM.score`` (both arms in one process, each
  an LLM planned for its own job: the time is the scoring's alone).

Each batch shape runs ``flexoff batch`` twice, sharing on then ``--no-prefix-sharing``, with the
same flags (default ``--policy auto --gpu-mem 16GiB --compress auto``: each arm plans for its own
job, the shared one for the prefixes it shares; ``--policy-flags`` runs both at one policy), and
reports each arm's whole-job wall time, prompts per second, the summary's lines and their ratio.
Each batch arm gets an empty Triton cache of its own (``--triton-cache each``), so that both pay the
4-bit codec's compilation as a first run on a machine does; ``shared`` keeps the environment's.

    python bench/shared_prefix.py --model opt-30b --shapes mmlu chat choices --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = (4, 50000)


def ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(count)]


def mmlu_prompts(rng: random.Random, subjects: int, draw=ids) -> list[list[int]]:
    """Subjects of 12 questions of 40-120 tokens, each subject's behind its 480-token head of
    in-context examples. ``draw(rng, count)``: the ids of ``count`` tokens."""
    prompts = []
    for _ in range(subjects):
        head = draw(rng, 480)
        prompts += [head + draw(rng, rng.randint(40, 120)) for _ in range(12)]
    return prompts


def mmlu(rng: random.Random, subjects: int = 57) -> list[dict]:
    return [{"id": f"{n // 12}.{n % 12}", "prompt": prompt, "max_new_tokens": 4}
            for n, prompt in enumerate(mmlu_prompts(rng, subjects))]


def choice_prompts(rng: random.Random, contexts: int, draw=ids) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, continuations): ``contexts`` contexts of 300-500 tokens, each the prompt of four
    continuations of 1-8 tokens. ``draw`` as for :func:`mmlu_prompts`."""
    heads = [draw(rng, rng.randint(300, 500)) for _ in range(contexts)]
    prompts = [c for c in heads for _ in range(4)]
    return prompts, [draw(rng, rng.randint(1, 8)) for _ in prompts]


def chat(rng: random.Random) -> list[dict]:
    system = ids(rng, 300)
    return [{"id": n, "prompt": system + ids(rng, rng.randint(20, 200)), "max_new_tokens": rng.randint(32, 128)}
            for n in range(240)]


SHAPES = {"mmlu": mmlu, "chat": chat}
SUMMARY_WORDS = ("tokens", "throughput", "prefill", "decode", "searched", "predict", "block", "shared")


def run_batch(args, shape: str, share: bool, out: Path) -> dict:
    job = out / f"{shape}.jsonl"
    result = out / f"{shape}.{'shared' if share else 'alone'}.out.jsonl"
    result.unlink(missing_ok=True)
    policy = args.policy_flags.split() if args.policy_flags else ["--policy", "auto", "--compress", args.compress]
    command = [sys.executable, "-m", "flexoff", "batch", "--model", args.model, "--dummy", "--input", str(job),
               "--output", str(result), *policy, "--gpu-mem", args.gpu_mem,
               "--ignore-eos", "--quiet", "--offload-dir", args.offload_dir]
    if args.hardware:
        command += ["--hardware", args.hardware]
    if not share:
        command.append("--no-prefix-sharing")
    env = dict(os.environ)
    if args.triton_cache == "each":
        # An empty Triton cache of the arm's own: each arm compiles the 4-bit codec's kernels as a
        # machine's first run does, rather than the second arm finding the first arm's.
        cache = out / f"triton-{shape}-{'shared' if share else 'alone'}"
        shutil.rmtree(cache, ignore_errors=True)
        env["TRITON_CACHE_DIR"] = str(cache)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False, env=env)
    wall = time.perf_counter() - start
    log = done.stdout + done.stderr
    (out / f"{shape}.{'shared' if share else 'alone'}.log").write_text(" ".join(command) + "\n" + log)
    if args.triton_cache == "each":
        shutil.rmtree(env["TRITON_CACHE_DIR"], ignore_errors=True)
    prompts = sum(1 for _ in job.open())
    return {"shape": shape, "sharing": share, "rc": done.returncode, "wall_s": round(wall, 2),
            "prompts_per_s": round(prompts / wall, 3),
            "summary": [line for line in log.splitlines() if any(w in line for w in SUMMARY_WORDS)][-20:]}


def choices(args, out: Path) -> list[dict]:
    """The multiple-choice job through LLM.score, each arm an LLM planned for its own job (the
    shared one for the prefix its rows share, measured from the prompts); the time is the
    scoring's alone."""
    from flexoff import LLM
    from flexoff.prompts import prompt_workload

    prompts, continuations = choice_prompts(random.Random(7), 200)
    whole = [p + c for p, c in zip(prompts, continuations)]
    rows = []
    for share in (True, False):
        workload = prompt_workload(whole, [1] * len(whole), args.model, None, share=share,
                                   keep=[len(c) + 1 for c in continuations])
        with LLM(args.model, dummy=True, policy="auto", gpu_mem=args.gpu_mem, compress=args.compress,
                 offload_dir=args.offload_dir, workload=workload, hardware=args.hardware,
                 prefix_sharing=share) as llm:
            start = time.perf_counter()
            llm.score(prompts, continuations)
            wall = time.perf_counter() - start
            rows.append({"shape": "choices", "sharing": share, "rc": 0, "wall_s": round(wall, 2),
                         "prompts_per_s": round(len(prompts) / 4 / wall, 3), "policy": str(llm.policy),
                         "workload": str(workload), "plan": llm.plan.message if llm.plan is not None else None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-30b")
    parser.add_argument("--shapes", nargs="+", default=["mmlu", "chat"], choices=[*SHAPES, "choices"])
    parser.add_argument("--gpu-mem", default="16GiB")
    parser.add_argument("--subjects", type=int, default=57,
                        help="mmlu: subjects of 12 questions each (default 57, MMLU's; fewer for a shorter run)")
    parser.add_argument("--compress", default="auto")
    parser.add_argument("--hardware", default=None)
    parser.add_argument("--policy-flags", help="one policy for both arms instead of --policy auto, as flexoff "
                        "batch's flags, e.g. '--gpu-batch-size 20 --num-gpu-batches 7 --percent 50 50 0 100 100 0'")
    parser.add_argument("--arms", nargs="+", choices=["on", "off"], default=["on", "off"],
                        help="which arms to run: sharing on, off (default both)")
    parser.add_argument("--offload-dir", default="/tmp")
    parser.add_argument("--triton-cache", choices=["each", "shared"], default="each",
                        help="batch arms: each an empty Triton cache of its own (default: both as a machine's "
                             "first run), or the environment's, which the first arm fills for the second")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes:
        if shape == "choices":
            rows += choices(args, args.out)
            continue
        rng = random.Random(0)
        with (args.out / f"{shape}.jsonl").open("w") as job:
            lines = mmlu(rng, args.subjects) if shape == "mmlu" else SHAPES[shape](rng)
            for line in lines:
                job.write(json.dumps(line) + "\n")
        for share in (arm == "on" for arm in args.arms):
            rows.append(run_batch(args, shape, share, args.out))
            print(json.dumps(rows[-1]), flush=True)
    for shape in args.shapes:
        on = next((r for r in rows if r["shape"] == shape and r["sharing"]), None)
        off = next((r for r in rows if r["shape"] == shape and not r["sharing"]), None)
        if on and off and on["rc"] == 0 and off["rc"] == 0:
            print(f"{shape}: sharing {on['prompts_per_s']} prompt/s, alone {off['prompts_per_s']} prompt/s, "
                  f"x{on['prompts_per_s'] / off['prompts_per_s']:.2f}")
    (args.out / "shared_prefix.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
