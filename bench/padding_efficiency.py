"""Padding efficiency of length-aware blocks on ExeGPT-like length distributions.

For each ExeGPT task (``shared/reference/anchors.md``: truncated normals of prompt and output
length), draw a 2,000-prompt job, run it through ``LLM.generate`` on a tiny dummy OPT, and
report the engine's own padded and actual token counts (FlexGen's Table 25 definitions):

    efficiency = (prompt tokens + generated tokens) / (padded prompt tokens + padded generated tokens)

Two settings per task:

- ``fixed``: prompt lengths from the distribution, one generation length for all (the output
  mean), as in a HELM scenario where every instance gets the same budget;
- ``varied``: output lengths drawn too, as per-prompt ``max_new_tokens``.

Generation ignores EOS, so every prompt uses its whole budget and the counts are exact.
Alongside, it prints what FlexGen's padding (every prompt to the longest, every output to the
largest budget) and unsorted blocks of the same size would cost on the same job.

    python bench/padding_efficiency.py [--prompts 2000] [--tasks summarization code] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexoff import LLM, Policy, SamplingParams  # noqa: E402
from flexoff.runtime.block_forming import padded_tokens  # noqa: E402

# ExeGPT's tasks: (mean, std, max) of prompt length, then of output length.
EXEGPT = {
    "summarization": ((256, 252, 512), (32, 13, 80)),
    "translation": ((128, 81, 256), (128, 68, 320)),
    "code": ((64, 23, 128), (192, 93, 480)),
    "conversational-1": ((256, 115, 512), (64, 30, 160)),
    "conversational-2": ((512, 252, 1024), (256, 134, 640)),
}
VOCAB = 512


def truncated_normal(rng: np.random.Generator, mean: float, std: float, maximum: int, count: int) -> np.ndarray:
    """Integer lengths from N(mean, std) restricted to [1, maximum], by rejection."""
    values: list[int] = []
    while len(values) < count:
        draw = np.rint(rng.normal(mean, std, 2 * count)).astype(int)
        values.extend(draw[(draw >= 1) & (draw <= maximum)].tolist())
    return np.array(values[:count])


def tiny_dummy_opt(directory: Path, max_positions: int) -> Path:
    """A config.json alone: with dummy=True, flexoff draws the weights itself."""
    config = {
        "model_type": "opt", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "ffn_dim": 64,
        "num_attention_heads": 4, "max_position_embeddings": max_positions, "word_embed_proj_dim": 32,
        "do_layer_norm_before": True, "activation_function": "relu", "pad_token_id": 1, "bos_token_id": 2,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def baselines(prompt_lens: np.ndarray, gen_lens: np.ndarray, block_size: int) -> dict[str, float]:
    actual = int(prompt_lens.sum() + gen_lens.sum())
    flexgen = len(prompt_lens) * int(prompt_lens.max() + gen_lens.max())
    unsorted = padded_tokens([list(range(i, min(i + block_size, len(prompt_lens))))
                              for i in range(0, len(prompt_lens), block_size)], prompt_lens, gen_lens)
    return {"flexgen_pad_to_longest": actual / flexgen, "unsorted_blocks": actual / unsorted}


def run_job(llm: LLM, rng: np.random.Generator, prompt_lens: np.ndarray, gen_lens: np.ndarray) -> dict:
    prompts = [rng.integers(3, VOCAB, size=int(n)).tolist() for n in prompt_lens]
    params = [SamplingParams(max_new_tokens=int(g), ignore_eos=True) for g in gen_lens]
    started = time.perf_counter()
    metrics = llm.generate(prompts, params).metrics
    return {
        "efficiency": metrics.efficiency, "prompt_tokens": metrics.prompt_tokens,
        "padded_prompt_tokens": metrics.padded_prompt_tokens, "generated_tokens": metrics.generated_tokens,
        "padded_generated_tokens": metrics.padded_generated_tokens,
        "actual_throughput": metrics.actual_throughput, "padded_throughput": metrics.padded_throughput,
        "wall_seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2000, help="prompts per job (default 2000)")
    parser.add_argument("--tasks", nargs="+", choices=list(EXEGPT), default=list(EXEGPT), help="ExeGPT tasks to run")
    parser.add_argument("--modes", nargs="+", choices=("fixed", "varied"), default=["fixed", "varied"])
    parser.add_argument("--gpu-batch-size", type=int, default=32, help="sequences per GPU batch (default 32)")
    parser.add_argument("--num-gpu-batches", type=int, default=1, help="GPU batches per block (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)

    policy = Policy(gpu_batch_size=args.gpu_batch_size, num_gpu_batches=args.num_gpu_batches)
    longest = max(EXEGPT[t][0][2] + EXEGPT[t][1][2] for t in args.tasks)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(tiny_dummy_opt(Path(tmp), longest)), dummy=True, policy=policy, seed=args.seed)
        print(f"{args.prompts} prompts per job · tiny dummy OPT on {llm.device} · blocks of "
              f"{policy.gpu_batch_size} × {policy.num_gpu_batches}")
        print(f"{'task':<18}{'lengths':<8}{'efficiency':>11}{'FlexGen pad':>13}{'unsorted':>10}"
              f"{'prompt act/pad':>20}{'gen act/pad':>20}{'wall s':>8}")
        for task in args.tasks:
            (p_mean, p_std, p_max), (g_mean, g_std, g_max) = EXEGPT[task]
            for mode in args.modes:
                rng = np.random.default_rng([args.seed, list(EXEGPT).index(task)])
                prompt_lens = truncated_normal(rng, p_mean, p_std, p_max, args.prompts)
                gen_lens = (np.full(args.prompts, g_mean) if mode == "fixed"
                            else truncated_normal(rng, g_mean, g_std, g_max, args.prompts))
                row = {"task": task, "mode": mode, **run_job(llm, rng, prompt_lens, gen_lens),
                       **baselines(prompt_lens, gen_lens, policy.block_size)}
                results.append(row)
                print(f"{task:<18}{mode:<8}{100 * row['efficiency']:>10.1f}%"
                      f"{100 * row['flexgen_pad_to_longest']:>12.1f}%{100 * row['unsorted_blocks']:>9.1f}%"
                      f"{row['prompt_tokens']:>11}/{row['padded_prompt_tokens']:<8}"
                      f"{row['generated_tokens']:>11}/{row['padded_generated_tokens']:<8}{row['wall_seconds']:>8.1f}",
                      flush=True)
        llm.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
