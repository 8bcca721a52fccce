"""The accuracy cost of group-wise compression on a trained model (by default SmolLM2-135M-Instruct,
the checkpoint of tests/smollm2.py), on a held-out public-domain text (tests/data/).

For each setting of the grid (float32, the reference; bfloat16; 4-bit weights, cache or both; 2-,
3- and 8-bit weights and cache; 4-bit at groups of 32 and 128), three figures:

- perplexity of the text by teacher-forced decoding (bench/teacher_forcing.py): windows of the
  text, each prefilled for a few tokens and then fed its true tokens one by one, so that nearly
  every position is predicted from keys and values read back from the (compressed) cache;
- greedy agreement with float32: greedy continuations of prompts cut from the text, and the share
  of their tokens that come before the first token where they part from float32's (the share of
  equal tokens position by position, after a divergence too, is in the JSON as ``tokenwise``);
- multiple-choice accuracy through ``flexoff eval`` (lm-evaluation-harness) on the task in
  tests/data/next_sentence/: which of four sentence openings follows a passage of the text. The
  setting reaches lm-eval as a policy file (``--model_args policy=FILE``). lm-eval scores choices
  by loglikelihood, one prefill each, which never reads the cache: only weight compression (and
  the dtype) can move this column.

Prints a markdown table and the versions, and writes both, with every figure, as JSON (``--out``).

    python bench/accuracy.py [--model DIR] [--out bench/accuracy.json] [--only NAME ...]
    python bench/accuracy.py --write-task    # remake tests/data/next_sentence/ from the text
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.teacher_forcing import decode_logprobs, perplexity  # noqa: E402
from flexoff import LLM, CompressionConfig, Policy  # noqa: E402
from flexoff.fileio import json_text, write_text_atomic  # noqa: E402
from flexoff.runtime.sampling import SamplingParams  # noqa: E402

TEXT = ROOT / "tests" / "data" / "pride-and-prejudice-ch16.txt"
TASK_DIR = ROOT / "tests" / "data" / "next_sentence"
TASK = "flexoff_next_sentence"
DOCS = "next_sentence.jsonl"  # the YAML names it from the repository's root, where flexoff eval runs


@dataclass(frozen=True)
class Setting:
    name: str
    dtype: str
    weight: CompressionConfig | None = None
    cache: CompressionConfig | None = None


def _both(bits: int, group: int = 64) -> dict:
    return dict(weight=CompressionConfig(bits, group), cache=CompressionConfig(bits, group))


# Compressed settings compute in float32, so that their distance from the reference is the codec's alone.
SETTINGS = [
    Setting("float32", "float32"),
    Setting("bfloat16", "bfloat16"),
    Setting("4-bit weights", "float32", weight=CompressionConfig(4, 64)),
    Setting("4-bit cache", "float32", cache=CompressionConfig(4, 64)),
    Setting("4-bit weights+cache", "float32", **_both(4)),
    Setting("8-bit weights+cache", "float32", **_both(8)),
    Setting("3-bit weights+cache", "float32", **_both(3)),
    Setting("2-bit weights+cache", "float32", **_both(2)),
    Setting("4-bit, group 32", "float32", **_both(4, 32)),
    Setting("4-bit, group 128", "float32", **_both(4, 128)),
]
REFERENCE = SETTINGS[0].name


# The text
def paragraphs(text: str) -> list[str]:
    """The chapter's paragraphs, each one line (Gutenberg wraps them at 70 columns); no heading."""
    found = [" ".join(block.split()) for block in text.split("\n\n") if block.strip()]
    return [p for p in found if not re.fullmatch(r"Chapter \d+", p)]


def held_out(text: str) -> str:
    return "\n\n".join(paragraphs(text))


def sentences(text: str) -> list[str]:
    """Sentences: a split after . ! ? (and a closing quote) before a capital, but not after Mr. or Mrs."""
    found = []
    for paragraph in paragraphs(text):
        start = 0
        for end in re.finditer(r"(?<=[.!?])[\"']?\s+(?=[\"'_]?[A-Z])", paragraph):
            piece = paragraph[start:end.end()].strip()
            if re.search(r"\b(Mr|Mrs|Dr|St)\.[\"']?$", piece):
                continue
            found.append(piece)
            start = end.end()
        found.append(paragraph[start:].strip())
    return found


def windows(ids: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` disjoint windows of ``length`` tokens from the text's start."""
    if count * length > len(ids):
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {count} windows of {length}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def greedy_prompts(ids: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, spread evenly over the text."""
    step = (len(ids) - length) // count
    return [ids[i * step:i * step + length] for i in range(count)]


# The multiple-choice task
def next_sentence_docs(text: str, count: int = 100, context_words: int = 16, choice_words: int = 10,
                       seed: int = 0) -> list[dict]:
    """For ``count`` sentences: the last ``context_words`` words before it, and its first
    ``choice_words`` words among three other sentences' (neither neighbour, none the same words)."""
    found = sentences(text)
    words = [s.split() for s in found]
    rng = random.Random(seed)
    picked = sorted(rng.sample(range(1, len(found)), count))
    docs = []
    for i in picked:
        before = " ".join(" ".join(found[:i]).split()[-context_words:])
        truth = " ".join(words[i][:choice_words])
        pool = [j for j in range(len(found)) if abs(j - i) > 1 and " ".join(words[j][:choice_words]) != truth]
        choices = [truth, *(" ".join(words[j][:choice_words]) for j in rng.sample(pool, 3))]
        rng.shuffle(choices)
        docs.append({"context": before, "choices": choices, "answer": choices.index(truth)})
    return docs


def task_yaml() -> str:
    return "\n".join([
        f"# Made by bench/accuracy.py --write-task from tests/data/{TEXT.name}; flexoff eval runs from the",
        "# repository's root, which data_files is relative to.",
        f"task: {TASK}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {(TASK_DIR / DOCS).relative_to(ROOT)}",
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{context}}"',
        'doc_to_choice: "{{choices}}"',
        'doc_to_target: "{{answer}}"',
        "metric_list:",
        "  - metric: acc",
        "  - metric: acc_norm",
        "",
    ])


def task_files(text: str) -> dict[str, str]:
    """The task's files, by name: what tests/data/next_sentence/ must hold."""
    docs = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in next_sentence_docs(text))
    return {f"{TASK}.yaml": task_yaml(), DOCS: docs}


def write_task() -> None:
    TASK_DIR.mkdir(parents=True, exist_ok=True)
    for name, content in task_files(TEXT.read_text(encoding="utf-8")).items():
        write_text_atomic(TASK_DIR / name, content)
        print(f"wrote {TASK_DIR / name}")


# Measurements
def policy_of(setting: Setting, rows: int) -> Policy:
    return Policy(gpu_batch_size=rows, num_gpu_batches=1, compress_weight=setting.weight,
                  compress_cache=setting.cache)


def held_out_ids(model: str) -> list[int]:
    """The held-out chapter in the model's tokens (no BOS: windows start anywhere in it)."""
    from flexoff.tokenizer import Tokenizer

    return Tokenizer.for_model(model).encode(held_out(TEXT.read_text(encoding="utf-8")), add_special_tokens=False)


def window_logprobs(llm, texts: list[list[int]], prefill: int) -> list[list[float]]:
    """Each window's tokens after its first ``prefill``, by teacher-forced decoding."""
    return decode_logprobs(llm, [w[:prefill] for w in texts], [w[prefill:] for w in texts])


def greedy_tokens(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """``prefix``: the share of tokens before each continuation's first difference from the
    reference's; ``tokenwise``: the share equal position by position."""
    total = sum(map(len, reference))
    prefix = 0
    for mine, theirs in zip(tokens, reference):
        prefix += next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(theirs))
    equal = sum(a == b for mine, theirs in zip(tokens, reference) for a, b in zip(mine, theirs))
    return {"prefix": prefix / total, "tokenwise": equal / total}


def mc_accuracy(model: str, setting: Setting, rows: int, threads: int, limit: int | None) -> dict:
    """The task's accuracy through ``flexoff eval``, in a child process run from the repository's root."""
    with tempfile.TemporaryDirectory() as tmp:
        policy_file = Path(tmp) / "policy.json"
        policy_of(setting, rows).save(policy_file)
        command = [sys.executable, "-m", "flexoff", "eval", "--model", "flexoff", "--model_args",
                   f"pretrained={model},policy={policy_file},dtype={setting.dtype},device=cpu,greedy_check=false",
                   "--tasks", TASK, "--include_path", str(TASK_DIR), "--output_path", str(Path(tmp) / "out"),
                   "--seed", "0", *(["--limit", str(limit)] if limit else [])]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"flexoff eval failed ({done.returncode}):\n{done.stderr[-3000:]}")
        results = json.loads(next(Path(tmp, "out").rglob("results_*.json")).read_text())["results"][TASK]
    return {"acc": results["acc,none"], "acc_norm": results["acc_norm,none"],
            "acc_stderr": results["acc_stderr,none"]}


def measure(model: str, setting: Setting, args, ids: list[int], reference: list[list[int]] | None) -> dict:
    texts = windows(ids, args.windows, args.window)
    prompts = greedy_prompts(ids, args.prompts, args.prompt_len)
    rows = max(len(texts), len(prompts))
    start = time.perf_counter()
    with LLM(model, policy=policy_of(setting, rows), dtype=setting.dtype, device="cpu") as llm:
        logprobs = window_logprobs(llm, texts, args.prefill)
        tokens = greedy_tokens(llm, prompts, args.new_tokens)
    result = {
        "setting": setting.name, "dtype": setting.dtype,
        "weight": None if setting.weight is None else [setting.weight.bits, setting.weight.group_size],
        "cache": None if setting.cache is None else [setting.cache.bits, setting.cache.group_size],
        "perplexity": perplexity(logprobs), "scored_positions": sum(map(len, logprobs)),
        "greedy_tokens": tokens, "agreement": agreement(tokens, reference or tokens),
    }
    if not args.no_mc:
        result["mc"] = mc_accuracy(model, setting, rows, args.threads, args.mc_limit)
    result["seconds"] = time.perf_counter() - start
    return result


# Report
def versions() -> dict:
    import lm_eval
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True)
    head = commit.stdout.strip() or "unknown"
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "lm_eval": getattr(lm_eval, "__version__", "unknown"),
            "flexoff": head + (" (with local changes)" if dirty.stdout.strip() else "")}


def _bits(config) -> str:
    return "-" if config is None else f"{config[0]} / {config[1]}"


def _figure(value: float, places: int) -> str:
    return f"{value:.{places}f}" if value < 1000 else f"{value:.3g}"


def table(results: list[dict]) -> str:
    reference = next((r for r in results if r["setting"] == REFERENCE), None)
    lines = ["| setting | dtype | weight bits / group | cache bits / group | perplexity | x float32 | "
             "greedy agreement | MC accuracy (acc_norm) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = _figure(r["perplexity"] / reference["perplexity"], 3) if reference else "-"
        mc = r.get("mc")
        mc_text = f"{mc['acc']:.2f} ({mc['acc_norm']:.2f})" if mc else "-"
        lines.append(f"| {r['setting']} | {r['dtype']} | {_bits(r['weight'])} | {_bits(r['cache'])} | "
                     f"{_figure(r['perplexity'], 2)} | {ratio} | {r['agreement']['prefix']:.3f} | {mc_text} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint directory (default: SmolLM2-135M-Instruct, tests/smollm2.py)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "accuracy.json"), help="the JSON results file")
    parser.add_argument("--only", action="append", help="run only this setting (repeatable; float32 always runs)")
    parser.add_argument("--windows", type=int, default=16, help="perplexity windows")
    parser.add_argument("--window", type=int, default=128, help="tokens a window")
    parser.add_argument("--prefill", type=int, default=8, help="tokens of a window prefilled; the rest are decoded")
    parser.add_argument("--prompts", type=int, default=8, help="greedy prompts")
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--mc-limit", type=int, help="questions of the task to ask (default: all 100)")
    parser.add_argument("--no-mc", action="store_true", help="skip the multiple-choice task")
    # Two threads that share two cores with other processes wait on each other: a decode step ran
    # ten times slower than on one thread, measured on the 2-core development machine.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--table", metavar="JSON", help="print the table of a results file and stop")
    parser.add_argument("--write-task", action="store_true", help="remake tests/data/next_sentence/ and stop")
    args = parser.parse_args()
    if args.write_task:
        write_task()
        return
    if args.table:
        print(table(json.loads(Path(args.table).read_text(encoding="utf-8"))["results"]), end="")
        return
    torch.set_num_threads(args.threads)
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        import smollm2

        args.model = str(smollm2.checkpoint())
    chosen = [s for s in SETTINGS if s.name == REFERENCE or s.name in (args.only or [s.name for s in SETTINGS])]
    unknown = set(args.only or []) - {s.name for s in SETTINGS}
    if unknown:
        raise SystemExit(f"unknown settings {sorted(unknown)}; known: {', '.join(s.name for s in SETTINGS)}")

    ids = held_out_ids(args.model)
    info = {"date": time.strftime("%Y-%m-%d"), "model": args.model, "versions": versions(),
            "command": " ".join(["python", "bench/accuracy.py", *sys.argv[1:]]), "text": TEXT.name,
            "text_tokens": len(ids), "threads": args.threads,
            **{k: getattr(args, k) for k in ("windows", "window", "prefill", "prompts", "prompt_len", "new_tokens",
                                             "mc_limit")}}
    print(json.dumps(info, indent=1), flush=True)
    results, started = [], time.perf_counter()
    for setting in chosen:
        reference = results[0]["greedy_tokens"] if results else None
        results.append(measure(args.model, setting, args, ids, reference))
        r = results[-1]
        print(f"{setting.name}: perplexity {r['perplexity']:.4f}, agreement {r['agreement']['prefix']:.3f}, "
              f"MC {r.get('mc')}, {r['seconds']:.0f} s", flush=True)
    info["seconds"] = time.perf_counter() - started
    write_text_atomic(args.out, json_text({**info, "results": results}, indent=1) + "\n")
    print(f"\n{table(results)}\n{len(chosen)} settings in {info['seconds']:.0f} s; results in {args.out}")


if __name__ == "__main__":
    main()
