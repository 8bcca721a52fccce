"""The ``flexoff batch`` and ``flexoff bench`` commands: they build the Job, make the LLM, hand both
to the harness (flexoff.harness.batch, flexoff.harness.bench) and print what it returns.

``register(subparsers)`` adds both to the ``flexoff`` parser; each sets ``args.handler``.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..errors import FlexoffError, OutputError
from ..progress import TOKEN_BAR_FORMAT
from .args import (COUNT, SEED, add_model_args, add_parallel_args, add_policy_args, add_runtime_switches,
                   add_quiet_arg, add_sampling_args, integer, job_from_args)
from .llm import job_deployment, make_llm
from .paths import check_outputs
from .report import format_summary, format_table


BATCH_EPILOG = """\
input: one JSON object per line
  {"id": "q1", "prompt": "text", "max_new_tokens": 16, "stop": ["\\n"], "meta": {...}}
  {"id": "c1", "messages": [{"role": "user", "content": "text"}]}   (a chat, through the chat template)
  id and prompt (or messages) are required (prompt may be a list of token ids); the rest are optional.
  Or OpenAI Batch API requests (a first line with "custom_id" makes the file one; see the README):
  {"custom_id": "r1", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body": {...}}
  whose output lines are OpenAI's: {"id", "custom_id", "response": {"status_code", "body"}, "error"}.
output: one JSON record per line, as blocks finish (sort by index for input order):
  index, id, kind, prompt, prompt_tokens, text, token_ids, logprobs, generated_tokens,
  finish_reason, error, block_size, block_seconds, finished_at (and meta);
  OUTPUT.job.json beside it names the job. One job at a time may write an output.
resume: rerun the same command; finished ids are skipped. An output of another job
  (other model, input or sampling flags) is refused: delete or move it to start fresh.
exit: 0 done; 1 done, but some sequences failed (their records carry the error);
  2 an error in the input, the flags or the output; 130 interrupted."""

BENCH_EPILOG = """\
data (--data): one JSON object per line
  {"id": "q1", "input": "text", "references": ["answer", ...], "split": "test"}
  mmlu: {"input": "question", "choices": ["a", "b", "c", "d"], "answer": "B"}
  split "train" marks in-context examples; synthetic_reasoning needs no file.
  Or a HELM run's scenario_state.json: its prompts and generation settings run as they are.
output (--output-dir): results.jsonl (resumable raw generations and reference scores, one
  record a line as `flexoff batch` writes them), instances.jsonl (per-instance metrics) and
  summary.json."""


class TqdmProgress:
    """A harness job's progress as a tqdm bar on stderr, or nothing when ``enabled`` is false."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bar = None

    def start(self, desc: str, unit: str, total: int, done: int) -> None:
        from tqdm import tqdm

        # Token counts come with their own time left in the note (it counts prefill; tqdm's would not).
        layout = {"bar_format": TOKEN_BAR_FORMAT} if unit == "tok" else {}
        self.bar = tqdm(total=total, initial=done, unit=unit, desc=desc, disable=not self.enabled,
                        dynamic_ncols=True, file=sys.stderr, **layout)

    def advance(self, count: int, note: str = "") -> None:
        if note:
            self.bar.set_postfix_str(note, refresh=False)
        self.bar.update(count)
        if not count:
            self.bar.refresh()

    def finish(self) -> None:
        self.bar.close()


def _dropped(store) -> None:
    if store.dropped_bytes:
        print(f"dropped a torn last line ({store.dropped_bytes} bytes) left by an interrupted run", file=sys.stderr)


def run_batch(args) -> int:
    from ..harness.batch import open_batch

    if not args.model:
        raise FlexoffError("batch needs --model (a registry name with --dummy, or a checkpoint directory)")
    check_outputs(args, {"--output": args.output})
    job = job_from_args(args)
    deployment = job_deployment(job)
    # In a parallel job rank 0 holds the output and speaks; every process runs the same prompts.
    speaks = deployment.ranks is None or deployment.ranks.rank == 0
    batch = open_batch(job, deployment, args.input, args.output, args.max_new_tokens)
    try:
        _dropped(batch.store)
        total = len(batch.lines)
        if batch.already == total:
            if not speaks:
                return 0
            print(f"all {total} prompts are already in {args.output}; nothing to do")
            return _failures(batch.failures(), batch.store.path)
        started = time.perf_counter()
        llm = make_llm(deployment, batch.job, batch.workload, args)
        try:
            try:
                metrics = batch.run(llm, TqdmProgress(not args.quiet and speaks))
            except KeyboardInterrupt:
                if speaks:
                    print(f"interrupted: {batch.done} of {total} prompts are in {args.output}; "
                          "rerun the same command to finish the rest", file=sys.stderr)
                return 130
            ranks_memory = llm.ranks_memory()
            if not speaks:
                return 0
            print(format_summary(llm, metrics, ranks_memory))
        finally:
            llm.close()
        note = f" ({batch.already} from an earlier run)" if batch.already else ""
        print(f"done       {total} prompts{note} · wall {time.perf_counter() - started:.1f} s · "
              f"results in {args.output}")
        return _failures(batch.failures(), batch.store.path)
    finally:
        batch.close()


def run_bench(args) -> int:
    from ..harness.bench import bench_output_dir, open_bench

    job = job_from_args(args)
    if not args.model:
        raise FlexoffError("bench needs --model (a checkpoint directory with a tokenizer)")
    output_dir = bench_output_dir(args.scenario, args.output_dir)
    check_outputs(args, {}, {"--output-dir": output_dir})
    deployment = job_deployment(job)
    bench = open_bench(job, deployment, args.scenario, args.data, output_dir, max_instances=args.max_instances,
                       num_in_context=args.num_in_context, subject=args.subject)
    try:
        _dropped(bench.store)
        llm = make_llm(deployment, job, lambda: bench.workload(deployment.config), args)
        try:
            metrics = bench.run(llm, TqdmProgress(not args.quiet))
        except KeyboardInterrupt:
            print(f"interrupted: results so far are in {bench.store.path}; rerun the same command to finish",
                  file=sys.stderr)
            return 130
        finally:
            llm.close()
        result = bench.finish(metrics, llm.config.name)
    finally:
        bench.close()
    print(format_table(result.summary))
    if result.problems:
        raise OutputError("; ".join(result.problems))
    print(f"wrote {bench.output_dir / 'instances.jsonl'} and {bench.output_dir / 'summary.json'}")
    return _failures(result.failures, bench.output_dir / "results.jsonl")


def _failures(failures: str | None, path) -> int:
    """1 after a one-line count on stderr when some results are errors, else 0."""
    if failures is None:
        return 0
    print(f"flexoff: {failures} (their records in {path} say why)", file=sys.stderr)
    return 1


def register(subparsers) -> None:
    """Add ``batch`` and ``bench`` to a subparsers object of the ``flexoff`` parser."""
    from ..harness.scenarios import SCENARIOS

    batch = subparsers.add_parser(
        "batch", help="resumable generation over a JSONL file of prompts",
        description="Generate for every prompt of a JSONL file, appending results to a JSONL output as "
                    "blocks finish. Rerunning the same command after a crash or Ctrl-C finishes the rest.",
        epilog=BATCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    files = batch.add_argument_group("files")
    files.add_argument("--input", required=True, metavar="FILE.jsonl", help="prompts, one JSON object per line")
    files.add_argument("--output", required=True, metavar="FILE.jsonl",
                       help="results; created, or resumed if it holds results of this same job")
    add_model_args(batch)
    add_runtime_switches(add_policy_args(batch))
    add_parallel_args(batch)
    add_sampling_args(batch)
    batch.add_argument("--max-new-tokens", type=COUNT, default=32, metavar="N",
                       help="tokens to generate per prompt, unless its line says otherwise (default 32)")
    add_quiet_arg(batch)
    batch.set_defaults(handler=run_batch)

    bench = subparsers.add_parser(
        "bench", help="run a HELM-style scenario and report accuracy and throughput",
        description="Run a scenario (" + ", ".join(SCENARIOS) + ") on a model: build HELM-style few-shot prompts, "
                    "generate, score the references, and write per-instance results and a summary table.",
        epilog=BENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--scenario", required=True, metavar="NAME",
                       help="one of: " + ", ".join(SCENARIOS))
    bench.add_argument("--data", metavar="FILE",
                       help="the scenario's instances, JSONL or a HELM run's scenario_state.json (required except "
                            "for synthetic_reasoning, which generates them)")
    bench.add_argument("--max-instances", type=COUNT, metavar="N",
                       help="evaluate N instances, sampled as HELM samples them (seed 0), so that small runs compare "
                            "(default: all; synthetic_reasoning: 1000 of its 10000)")
    bench.add_argument("--num-in-context", type=integer(0), metavar="K",
                       help="in-context examples per prompt (default: the scenario's, 3 or 5)")
    bench.add_argument("--subject", help="mmlu: the subject named in the instructions (default: from the data file name)")
    bench.add_argument("--seed", type=SEED, default=0,
                       help="seed for example choice, sampling, generated data and dummy weights (default 0)")
    bench.add_argument("--output-dir", metavar="DIR", help="where results go (default flexoff-bench/NAME)")
    add_quiet_arg(bench)
    add_model_args(bench)
    add_runtime_switches(add_policy_args(bench, planning=False))  # bench runs the policy it is given: it plans nothing
    bench.set_defaults(handler=run_bench)

