"""The ``flexoff`` command line. Thin: it parses flags, calls the API, and prints.

Every user error ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from .errors import FlexoffError, OutputError, TokenizerError, error_line
from .harness import cli as harness_cli
from .planner import cli as planner_cli
from .checks import MAX_SEED
from .cli_args import COUNT, DEVICE, DTYPE, NONEMPTY, SEED, SIZE, Parser, integer, number
from .fileio import check_destination, json_text, write_or_keep
from .policy import SUPPORTED_BITS
from .units import format_size

DEFAULT_MODEL = "opt-125m"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument("--model",
                       help="registry name (e.g. opt-30b, llama-3-8b; needs --dummy), a local Hugging Face "
                            "checkpoint directory, or a Hugging Face Hub id (e.g. facebook/opt-1.3b: taken from the "
                            "Hub cache or downloaded; with --dummy only its config.json) "
                            f"(`flexoff run` alone runs {DEFAULT_MODEL} with dummy weights)")
    group.add_argument("--dummy", action="store_true",
                       help="seeded random weights instead of a checkpoint (no download; for benchmarks)")
    group.add_argument("--dtype", default="auto", type=DTYPE,
                       help="float16, bfloat16, float32, or auto (float16 on CUDA, float32 on CPU)")
    group.add_argument("--device", default="auto", type=DEVICE, help="compute device: cuda, cuda:N, cpu, or auto")
    group.add_argument("--tokenizer", help="directory with tokenizer files, if not the checkpoint's")


def add_policy_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "policy", "Where weights, KV cache and activations live, and how blocks are batched. Flags given "
                  "here override the --policy file; without either, everything stays on the GPU.")
    group.add_argument("--policy", help="policy JSON file (see `flexoff search --output`), or auto: search the best "
                                        "policy for this job first (see --hardware)")
    group.add_argument("--hardware", metavar="NAME|FILE",
                       help="hardware profile --policy auto plans for: t4, h100, h200 or a `flexoff profile` JSON "
                            "(default: the one `flexoff profile` saved for this machine)")
    group.add_argument("--percent", type=number(0, 100), nargs=6, metavar=("W_GPU", "W_CPU", "C_GPU", "C_CPU", "A_GPU", "A_CPU"),
                       help="percent of weights, KV cache and activations on gpu and cpu (each pair at most 100 "
                            "together); the rest goes to disk")
    group.add_argument("--gpu-batch-size", type=COUNT, help="sequences per GPU batch")
    group.add_argument("--num-gpu-batches", type=COUNT, help="GPU batches per block (they share one weight load)")
    group.add_argument("--cpu-attention", action="store_true", default=None,
                       help="run decode attention on the CPU for cache rows held off the GPU")
    group.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                       help="run loads, stores and compute one after another (for measuring)")
    group.add_argument("--no-pin", dest="pin_cpu_memory", action="store_false", default=None,
                       help="do not pin host memory (slower copies, but no page-locked RAM)")
    group.add_argument("--compress-weight", action="store_true", default=None,
                       help="store weights 4-bit group-quantized on every tier (dequantized on the GPU before use)")
    group.add_argument("--weight-bits", type=int, default=4, choices=SUPPORTED_BITS,
                       help="bits per weight when compressed (2, 3, 4 or 8)")
    group.add_argument("--weight-group", type=integer(2), default=64, help="group size for weight compression (>= 2)")
    group.add_argument("--compress-cache", action="store_true", default=None,
                       help="store the KV cache group-quantized on every tier")
    group.add_argument("--cache-bits", type=int, default=4, choices=SUPPORTED_BITS,
                       help="bits per cache value when compressed (2, 3, 4 or 8)")
    group.add_argument("--cache-group", type=integer(2), default=64, help="group size for cache compression (>= 2)")
    group.add_argument("--offload-dir", help="directory for the disk tier (default: $FLEXOFF_OFFLOAD_DIR); "
                                             "flexoff makes a private folder inside it and removes it on exit")
    group.add_argument("--gpu-mem", metavar="SIZE", type=SIZE, help="cap flexoff's GPU memory, e.g. 16GiB (emulates a smaller card)")
    group.add_argument("--cpu-mem", metavar="SIZE", type=SIZE, help="cap flexoff's host memory, e.g. 200GiB")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=number(0), default=0.0, help="0 (default) is greedy")
    group.add_argument("--top-k", type=integer(0), default=0, help="keep the k most likely tokens (0: all)")
    group.add_argument("--top-p", type=number(maximum=1, above=0), default=1.0,
                       help="nucleus sampling mass, in (0, 1] (1: all)")
    group.add_argument("--seed", type=SEED, default=0, help=f"seed for sampling and dummy weights (0 to {MAX_SEED})")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", type=NONEMPTY,
                       help="stop a sequence when its text contains TEXT (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def policy_from_args(args, workload=None):
    """The policy the flags describe: a file (or a search, for auto), then batch-size flags on top;
    None for the default. ``workload``: a callable giving the job's planner Workload."""
    from dataclasses import replace

    from .api import DEFAULT_POLICY
    from .policy import CompressionConfig, Policy, placement_from_percent

    if args.policy == "auto":
        policy = searched_policy(args, workload)
    else:
        policy = Policy.load(args.policy) if args.policy else None
    overrides = {name: getattr(args, name) for name in ("gpu_batch_size", "num_gpu_batches", "cpu_attention",
                                                        "overlap", "pin_cpu_memory")
                 if getattr(args, name, None) is not None}
    if getattr(args, "percent", None):
        overrides.update(placement_from_percent(args.percent))
    if getattr(args, "compress_weight", None):
        overrides["compress_weight"] = CompressionConfig(args.weight_bits, args.weight_group)
    if getattr(args, "compress_cache", None):
        overrides["compress_cache"] = CompressionConfig(args.cache_bits, args.cache_group)
    if overrides:
        policy = replace(policy or DEFAULT_POLICY, **overrides)
    return policy


def searched_policy(args, workload):
    """The planner's best policy for this job on the --hardware profile, within --gpu-mem/--cpu-mem."""
    from .api import resolve_device, resolve_dtype
    from .models import resolve_model_config
    from .planner.report import policy_summary
    from .planner.search import search_policy
    from .units import parse_size

    if workload is None:
        raise FlexoffError(f"--policy auto works with `flexoff run` and `flexoff batch`, not `flexoff {args.command}`: "
                           "save a policy with `flexoff search --output FILE` and pass --policy FILE")
    device = resolve_device(args.device)
    if resolve_dtype(args.dtype, device).itemsize != 2:
        raise FlexoffError("--policy auto plans 16-bit weights and cache; pass --dtype float16 or bfloat16")
    config = resolve_model_config(args.model or DEFAULT_MODEL)
    caps = [parse_size(value) if value else None for value in (args.gpu_mem, args.cpu_mem)]
    hardware = hardware_profile(args, device).with_memory(*caps)
    job = workload()
    result = search_policy(config, job, hardware)
    print(f"searched   {policy_summary(result.policy)} for prompt {job.prompt_len}, generate {job.gen_len} on "
          f"{hardware.name}: {result.throughput:.4g} token/s predicted", file=sys.stderr)
    return result.policy


def hardware_profile(args, device):
    """The profile planning uses: --hardware, else this machine's saved one, measured quickly (and
    saved) the first time."""
    from .profiler import saved_or_measured_profile
    from .planner.hardware import resolve_hardware

    if args.hardware:
        return resolve_hardware(args.hardware)
    return saved_or_measured_profile(device, offload_dir_of(args),
                                     lambda message: print(f"profile    {message}", file=sys.stderr))


def offload_dir_of(args) -> str | None:
    return getattr(args, "offload_dir", None) or os.environ.get("FLEXOFF_OFFLOAD_DIR")


def sampling_from_args(args, max_new_tokens: int, stop=()):
    from .runtime.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=tuple(args.stop) + tuple(stop), ignore_eos=args.ignore_eos,
    )


def make_llm(args, workload=None):
    """The LLM the flags describe. ``workload`` (a callable giving the planner's Workload) serves
    --policy auto, lets a job that cannot fit be refused before anything is allocated, and, with no
    policy flags, plans a policy when the job does not fit the device (the plan is printed)."""
    from functools import cache

    from .api import LLM, resolve_device

    model, dummy = (args.model, args.dummy) if args.model else (DEFAULT_MODEL, True)
    workload = cache(workload) if workload is not None else None  # text prompts are tokenized once

    def measured_workload():
        try:
            return workload()
        except TokenizerError:  # text without a tokenizer: the prompts' own check names the line at fault
            return None

    llm = LLM(model, dummy=dummy, policy=policy_from_args(args, workload), dtype=args.dtype, device=args.device,
              seed=args.seed, tokenizer=args.tokenizer, offload_dir=offload_dir_of(args),
              gpu_mem=getattr(args, "gpu_mem", None), cpu_mem=getattr(args, "cpu_mem", None),
              workload=measured_workload if workload is not None else None,
              hardware=lambda: hardware_profile(args, resolve_device(args.device)))
    if llm.plan is not None and llm.plan.message:
        print(llm.plan.message, file=sys.stderr)
    return llm


def _split(fractions) -> str:
    return "/".join(f"{100 * value:.1f}" for value in fractions)


def format_summary(llm, metrics) -> str:
    from .layout import tier_name
    from .policy import TIERS

    policy = llm.policy
    placement = llm.engine.placement_report
    peaks = dict(metrics.peak_memory)
    peaks.pop("cpu_weights", None)  # the weights line says where every weight is
    ram = f"ram {format_size(peaks.pop('cpu_rss', 0))} (process rss"
    ram += f": the {tier_name('gpu', llm.device)} and cpu tiers)" if llm.device.type != "cuda" else ": the cpu tier)"
    memory = [f"{tier_name('gpu', llm.device)} {format_size(peaks.pop('gpu'))}"] if "gpu" in peaks else []
    memory += [ram] + [f"{key} {format_size(value)}" for key, value in peaks.items()]
    lines = [
        f"model      {llm.config.name} · {str(llm.dtype).removeprefix('torch.')} on {llm.device} · "
        f"{metrics.num_sequences} prompts · gpu batch {policy.gpu_batch_size} × {policy.num_gpu_batches}",
        f"policy     % on {'/'.join(tier_name(t, llm.device) for t in TIERS)}: weights requested "
        f"{_split(placement['requested'].values())}, realised {_split(placement['realised'].values())} · "
        f"cache {_split(policy.cache.as_tuple())} · activations {_split(policy.activations.as_tuple())} · "
        f"cpu attention {'on' if policy.cpu_attention else 'off'} · overlap {'on' if policy.overlap else 'off'}",
        "weights    " + " · ".join(f"{tier_name(t, llm.device)} {format_size(placement['bytes'][t])}" for t in TIERS),
        f"prefill    {metrics.prefill_throughput:12.1f} token/s  ({metrics.prefill_time:.3f} s)",
        f"decode     {metrics.decode_throughput:12.1f} token/s  ({metrics.decode_time:.3f} s)",
        f"total      {metrics.total_throughput:12.1f} token/s  ({metrics.total_time:.3f} s)",
        f"tokens     prompt {metrics.prompt_tokens} actual / {metrics.padded_prompt_tokens} padded · "
        f"generated {metrics.generated_tokens} actual / {metrics.padded_generated_tokens} padded · "
        f"efficiency {100 * metrics.efficiency:.1f}%",
        "peak mem   " + " · ".join(memory),
    ]
    return "\n".join(lines)


def cmd_run(args) -> int:
    from .planner.cost_model import Workload
    from .prompts import prompt_workload, read_prompts, synthetic_prompts
    from .records import Block

    # Destinations first: a path that cannot be written should fail now, not after generating.
    for path, flag in ((args.output, "--output"), (args.metrics_json, "--metrics-json")):
        if path:
            check_destination(path, flag)
    lines = read_prompts(args.prompts) if args.prompts else None

    def workload() -> Workload:
        if lines is None:
            return Workload(args.prompt_len, args.gen_len, args.num_prompts)
        return prompt_workload([line.prompt for line in lines], [line.max_new_tokens or args.gen_len for line in lines],
                               args.model or DEFAULT_MODEL, args.tokenizer)

    llm = make_llm(args, workload)
    blocks: dict[int, Block] = {}  # each output's block, for its record

    def on_block(outputs, metrics) -> None:
        block = Block.now(len(outputs), metrics.total_time)
        blocks.update((out.index, block) for out in outputs)

    try:
        if lines is not None:
            prompts = [line.prompt for line in lines]
            params = [sampling_from_args(args, line.max_new_tokens or args.gen_len, line.stop) for line in lines]
            ids = [line.id for line in lines]
        else:
            prompts = synthetic_prompts(llm.config, args.num_prompts, args.prompt_len, args.seed)
            params = [sampling_from_args(args, args.gen_len)] * len(prompts)
            ids = [None] * len(prompts)
        if args.warmup:
            # A short pass first, so one-time costs (kernel selection, allocator growth) stay out of the timing.
            llm.generate([p[:32] if isinstance(p, list) else p for p in prompts],
                         sampling_from_args(args, 1))
        result = llm.generate(prompts, params, progress=not args.quiet, on_block=on_block)
    finally:
        llm.close()
    return _write_run_outputs(args, llm, result, ids, blocks)


def _write_run_outputs(args, llm, result, ids, blocks) -> int:
    """Write the results and metrics; a write that fails keeps its text elsewhere and ends the run
    with one line naming where. Exit code 1 when some sequences failed, 0 otherwise."""
    from .records import failure_line, generation_record, record_line

    records = [generation_record(out, blocks[out.index], id=line_id) for out, line_id in zip(result, ids)]
    problems = []
    if args.output:
        problems.append(write_or_keep(args.output, "".join(record_line(r) + "\n" for r in records),
                                      f"the {len(records)} results"))
    if args.metrics_json:
        problems.append(write_or_keep(args.metrics_json, json_text(result.metrics.to_dict(), indent=2) + "\n",
                                      "the metrics"))
    print(format_summary(llm, result.metrics))
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
                             "token ids, and optional \"id\", \"max_new_tokens\", \"stop\", \"meta\"), .json (one "
                             "list of such objects or of bare prompts), else text with one prompt per line")
    source.add_argument("--prompt-len", type=COUNT, default=64, help="synthetic prompt length in tokens (default 64)")
    source.add_argument("--num-prompts", type=COUNT, default=16, help="number of synthetic prompts (default 16)")
    source.add_argument("--gen-len", "--max-new-tokens", dest="gen_len", type=COUNT, default=32,
                        help="tokens to generate per prompt (default 32)")
    add_policy_args(parser)
    add_sampling_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--output", metavar="FILE.jsonl", help="write one JSON result per prompt (atomically)")
    out.add_argument("--metrics-json", metavar="FILE", help="write the metrics record as JSON")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
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
    planner_cli.register(subparsers)
    harness_cli.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error the parser printed as one line
        return exc.code or 0
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.handler(args)
    except FlexoffError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flexoff: interrupted", file=sys.stderr)
        return 130


def _terminate(signum, frame):
    # Unwinding through the handlers' finally blocks removes offload files on SIGTERM too.
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
