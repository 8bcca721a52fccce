"""The ``flexoff batch`` and ``flexoff bench`` subcommands.

``register(subparsers)`` adds both to the ``flexoff`` parser; each sets ``args.handler``.
``python -m flexoff.harness.cli`` runs them on their own, with the same error handling.
"""

from __future__ import annotations

import argparse
import sys

from ..cli_args import COUNT, SEED, integer


BATCH_EPILOG = """\
input: one JSON object per line
  {"id": "q1", "prompt": "text", "max_new_tokens": 16, "stop": ["\\n"], "meta": {...}}
  id and prompt are required (prompt may be a list of token ids); the rest are optional.
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
output (--output-dir): results.jsonl (resumable raw generations and reference scores, one
  record a line as `flexoff batch` writes them), instances.jsonl (per-instance metrics) and
  summary.json."""


def _batch_handler(args) -> int:
    from .. import cli as main_cli
    from .batch import run_batch

    return run_batch(args, main_cli.make_llm, main_cli.format_summary)


def _bench_handler(args) -> int:
    from .. import cli as main_cli
    from .bench import run_bench

    return run_bench(args, main_cli.make_llm)


def register(subparsers) -> None:
    """Add ``batch`` and ``bench`` to a subparsers object of the ``flexoff`` parser."""
    from .. import cli as main_cli  # shared model, policy and sampling flags
    from .scenarios import SCENARIOS

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
    main_cli.add_model_args(batch)
    main_cli.add_policy_args(batch)
    main_cli.add_sampling_args(batch)
    batch.add_argument("--max-new-tokens", type=COUNT, default=32, metavar="N",
                       help="tokens to generate per prompt, unless its line says otherwise (default 32)")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    batch.set_defaults(handler=_batch_handler)

    bench = subparsers.add_parser(
        "bench", help="run a HELM-style scenario and report accuracy and throughput",
        description="Run a scenario (" + ", ".join(SCENARIOS) + ") on a model: build HELM-style few-shot prompts, "
                    "generate, score the references, and write per-instance results and a summary table.",
        epilog=BENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--scenario", required=True, metavar="NAME",
                       help="one of: " + ", ".join(SCENARIOS))
    bench.add_argument("--data", metavar="FILE.jsonl",
                       help="the scenario's instances (required except for synthetic_reasoning, which generates them)")
    bench.add_argument("--max-instances", type=COUNT, metavar="N",
                       help="evaluate the first N instances (default: all; synthetic_reasoning generates 1000)")
    bench.add_argument("--num-in-context", type=integer(0), metavar="K",
                       help="in-context examples per prompt (default: the scenario's, 3 or 5)")
    bench.add_argument("--subject", help="mmlu: the subject named in the instructions (default: from the data file name)")
    bench.add_argument("--seed", type=SEED, default=0,
                       help="seed for example choice, sampling, generated data and dummy weights (default 0)")
    bench.add_argument("--output-dir", metavar="DIR", help="where results go (default flexoff-bench/NAME)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    main_cli.add_model_args(bench)
    main_cli.add_policy_args(bench)
    bench.set_defaults(handler=_bench_handler)


def main(argv: list[str] | None = None) -> int:
    """The whole ``flexoff`` command line, which holds these commands too."""
    from ..cli import main as flexoff_main

    return flexoff_main(argv)


if __name__ == "__main__":
    sys.exit(main())
