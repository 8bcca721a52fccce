"""The ``flexoff`` command line and its ``run`` command. Thin: it parses flags into a Job, calls the
API, and prints.

Every user error ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from ..errors import FlexoffError, OutputError, error_line
from ..fileio import check_destination, json_text, write_or_keep
from ..job import DEFAULT_MODEL
from . import harness, search
from .args import (COUNT, Parser, add_model_args, add_parallel_args, add_policy_args, add_runtime_switches,
                   add_quiet_arg, add_sampling_args, job_from_args)
from .launch import check_before_launch, launch, needs_launch
from .llm import job_deployment, make_llm
from .paths import check_outputs
from .report import format_summary

def cmd_run(args) -> int:
    from ..planner.cost_model import Workload
    from ..prompts import as_chat, line_prompt, prompt_workload, read_prompts, synthetic_prompts
    from ..records import Block

    # Destinations first: a path that cannot be written should fail now, not after generating.
    check_outputs(args, {"--output": args.output, "--metrics-json": args.metrics_json})
    for path, flag in ((args.output, "--output"), (args.metrics_json, "--metrics-json")):
        if path:
            check_destination(path, flag)
    job = job_from_args(args)
    lines = read_prompts(args.prompts) if args.prompts else None
    if args.chat:
        if lines is None:
            raise FlexoffError("--chat needs --prompts FILE: each of its prompts becomes one user message")
        lines = [as_chat(line, f"{args.prompts} line {line.line}") for line in lines]

    def workload() -> Workload:
        if lines is None:
            return Workload(args.prompt_len, args.gen_len, args.num_prompts)
        return prompt_workload([line.prompt if line.messages is None else line.messages for line in lines],
                               [line.max_new_tokens or args.gen_len for line in lines], job.model, job.tokenizer,
                               job.prefix_sharing)

    llm = make_llm(job_deployment(job), job, workload, args)
    blocks: dict[int, Block] = {}  # each output's block, for its record

    def on_block(outputs, metrics) -> None:
        block = Block.now(len(outputs), metrics.total_time)
        blocks.update((out.index, block) for out in outputs)

    try:
        if lines is not None:
            # Chat lines go through the chat template, as LLM.chat does; their records keep its text.
            encoded = [(line.prompt, None) if line.messages is None else
                       line_prompt(line, f"{args.prompts} line {line.line}", llm.config, llm.tokenizer)
                       for line in lines]
            prompts, texts = [p for p, _ in encoded], [t for _, t in encoded]
            params = [job.sampling(line.max_new_tokens or args.gen_len, line.stop, job.seed) for line in lines]
            ids = [line.id for line in lines]
        else:
            prompts = synthetic_prompts(llm.config, args.num_prompts, args.prompt_len, job.seed)
            texts = [None] * len(prompts)
            params = [job.sampling(args.gen_len, seed=job.seed)] * len(prompts)
            ids = [None] * len(prompts)
        if args.warmup:
            # A short pass first, so one-time costs (kernel selection, allocator growth) stay out of the timing.
            llm.generate([p[:32] if isinstance(p, list) else p for p in prompts],
                         job.sampling(1, seed=job.seed))
        result = llm.generate(prompts, params, progress=not args.quiet, on_block=on_block)
        ranks_memory = llm.ranks_memory()
    finally:
        llm.close()
    if llm.ranks is not None and llm.ranks.rank != 0:  # every process has the results; rank 0 reports them
        return 0
    return _write_run_outputs(args, llm, result, ids, blocks, texts, ranks_memory)


def _write_run_outputs(args, llm, result, ids, blocks, texts, ranks_memory=None) -> int:
    """Write the results and metrics; a write that fails keeps its text elsewhere and ends the run
    with one line naming where. Exit code 1 when some sequences failed, 0 otherwise."""
    from ..records import failure_line, generation_record, record_line

    records = [generation_record(out, blocks[out.index], id=line_id, prompt=text)
               for out, line_id, text in zip(result, ids, texts)]
    problems = []
    if args.output:
        problems.append(write_or_keep(args.output, "".join(record_line(r) + "\n" for r in records),
                                      f"the {len(records)} results"))
    if args.metrics_json:
        # The policy that ran goes with the figures: they mean nothing without it, and it says
        # whether the outputs were compressed.
        metrics = {**result.metrics.to_dict(), "policy": llm.policy.to_dict()}
        problems.append(write_or_keep(args.metrics_json, json_text(metrics, indent=2) + "\n", "the metrics"))
    print(format_summary(llm, result.metrics, ranks_memory))
    problems = [p for p in problems if p]
    if problems:
        raise OutputError("; ".join(problems))
    if args.output:
        print(f"wrote {len(result)} results to {args.output}")
    failures = failure_line(records)
    if failures:
        where = f" (their records in {args.output} say why)" if args.output else ""
        print(f"flexoff: {failures}{where}", file=sys.stderr)
        return 1
    return 0


def register_run(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="generate for a batch of prompts and report throughput",
        description="Generate for prompts from a file, or for synthetic prompts of a fixed length, and print "
                    "prefill / decode / total throughput, padding and peak memory. With no flags it runs "
                    f"{DEFAULT_MODEL} with dummy weights on synthetic prompts.",
    )
    add_model_args(parser)
    source = parser.add_argument_group("prompts")
    source.add_argument("--prompts", metavar="FILE",
                        help="by extension, in any case: .jsonl (one object per line with \"prompt\", text or "
                             "token ids, or \"messages\", a chat conversation, and optional \"id\", "
                             "\"max_new_tokens\", \"stop\", \"meta\"), .json (one list of such objects or of bare "
                             "prompts), else text with one prompt per line")
    source.add_argument("--chat", action="store_true",
                        help="put each prompt through the model's chat template as one user message (as LLM.chat; "
                             "JSONL lines with \"messages\" are chats with or without it)")
    source.add_argument("--prompt-len", type=COUNT, default=64, help="synthetic prompt length in tokens (default 64)")
    source.add_argument("--num-prompts", type=COUNT, default=16, help="number of synthetic prompts (default 16)")
    source.add_argument("--gen-len", "--max-new-tokens", dest="gen_len", type=COUNT, default=32,
                        help="tokens to generate per prompt (default 32)")
    add_runtime_switches(add_policy_args(parser))
    add_parallel_args(parser)
    add_sampling_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--output", metavar="FILE.jsonl", help="write one JSON result per prompt (atomically)")
    out.add_argument("--metrics-json", metavar="FILE", help="write the metrics record as JSON")
    add_quiet_arg(out)
    out.add_argument("--warmup", action="store_true",
                     help="run a short untimed pass first (for benchmarks: keeps one-time costs out of the figures)")
    parser.set_defaults(handler=cmd_run)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="flexoff",
        description="High-throughput batch LLM inference on one GPU with too little memory.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_run(subparsers)
    search.register(subparsers)
    harness.register(subparsers)
    # Listed for --help only: main() hands `eval` and its arguments to lm_eval before parsing.
    subparsers.add_parser("eval", help="lm-evaluation-harness with the flexoff model: `flexoff eval --model "
                                       "flexoff --model_args pretrained=DIR --tasks TASK` (see `flexoff eval --help`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "eval":  # every other argument is lm_eval's, for its own parser
        from .lm_eval import main as evaluate

        return evaluate(argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error the parser printed as one line
        return exc.code or 0
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        size = needs_launch(args)
        if size:
            job = job_from_args(args)
            check_before_launch(job, size)
            return launch(argv, size, job.offload_root)
        return args.handler(args)
    except FlexoffError as exc:
        if not getattr(exc, "said_by_rank0", False):  # a parallel job's error says itself once
            print(error_line(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flexoff: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`flexoff search | head`)
        _silence_stdout()
        return 141  # what a shell reports for a process ended by SIGPIPE
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if isinstance(exc, RuntimeError) and lost_peers(exc):
            print(f"flexoff: error: rank {os.environ['RANK']} lost its peers ({_first_line(exc)}); a process of the "
                  "job ended or stopped answering", file=sys.stderr)
            return 1
        if not isinstance(exc, MemoryError) and type(exc).__name__ != "OutOfMemoryError":
            raise
        print(out_of_memory_line(exc), file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit finds no closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (a test's capture)
        pass
    finally:
        os.close(devnull)


def lost_peers(exc: RuntimeError) -> bool:
    """Whether a parallel job's process failed because a peer died or went silent (a collective's
    timeout, a closed connection), as torch.distributed reports it."""
    if "RANK" not in os.environ:
        return False
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(word in text for word in ("gloo", "nccl", "connection closed by peer", "connection reset by peer"))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def out_of_memory_line(exc: BaseException) -> str:
    """One line for memory that ran out past the plan's check (results written so far are kept:
    the batch and bench commands resume from them)."""
    where = "host" if isinstance(exc, MemoryError) else "GPU"
    first = ". ".join(str(exc).split(". ")[:2]).strip() or type(exc).__name__  # torch's: what, and how much
    return (f"flexoff: error: out of {where} memory while running ({first}); the policy's memory estimate fell short: "
            "retry with a smaller --gpu-batch-size or --num-gpu-batches, or a lower --gpu-mem/--cpu-mem cap")


def _terminate(signum, frame):
    # Unwinding through the handlers' finally blocks removes offload files on SIGTERM too.
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
