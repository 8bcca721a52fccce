"""The ``search`` and ``profile`` commands; the ``flexoff`` parser adds them with ``register``."""

from __future__ import annotations

import time

from ..errors import ConfigError, PolicyError
from ..fileio import check_destination
from ..models import resolve_model_config
from ..planner.cost_model import Workload
from ..planner.coverage import extrapolation_note
from ..planner.hardware import PACKAGED_PROFILES, default_profile_path, resolve_hardware
from ..planner.report import policy_summary
from ..planner.search import pareto_frontier, search_policy
from ..policy import CHOICES
from ..units import parse_size
from .args import COUNT, SIZE, SIZES, add_compress_arg, integer, number
from .paths import check_outputs
from .report import (describe_hardware, format_frontier, format_pipeline_plan, format_prediction, frontier_title,
                     plot_frontier, write_frontier_csv)


def register(subparsers) -> None:
    """Add ``search`` and ``profile`` to an argparse subparsers object."""
    search = subparsers.add_parser(
        "search", help="find the best policy for a model on a machine, without running it",
        description="Search GPU batch size x number of GPU batches, solving an LP over the nine placement "
                    "fractions for each, and print the policy with the highest predicted throughput.",
    )
    search.add_argument("--model", required=True,
                        help="registry name (e.g. opt-30b), checkpoint directory, or Hugging Face Hub id "
                             "(e.g. facebook/opt-30b; only its config.json is fetched)")
    _add_workload_args(search)
    search.add_argument("--hardware", default=None,
                        help=f"profile: {' or '.join(sorted(set(PACKAGED_PROFILES)))} (packaged), or a JSON file; "
                             f"default: this machine's profile from `flexoff profile` ({default_profile_path()})")
    for tier in ("gpu", "cpu", "disk"):
        search.add_argument(f"--{tier}-mem", default=None, metavar="SIZE", type=SIZES if tier == "gpu" else SIZE,
                            help=f"override the profile's {tier} memory, e.g. 16GiB or 1.5TB "
                                 "(the profile's headroom still applies)"
                                 + ("; with --pipeline-parallel, one size for every GPU or one per stage, "
                                    "e.g. 16GiB,24GiB" if tier == "gpu" else ""))
    search.add_argument("--pipeline-parallel", type=COUNT, default=1, metavar="N",
                        help="plan N pipeline stages, one per GPU, which share the host's memory (default 1)")
    search.add_argument("--data-parallel", type=COUNT, default=1, metavar="M",
                        help="M replicas of the pipeline on the same host (default 1)")
    add_compress_arg(search, "off")  # lossless unless asked, as `run --policy auto` plans
    search.add_argument("--cpu-attention", choices=CHOICES, default="auto",
                        help="decode attention on the CPU for the cache that is not on the GPU: auto, on, off")
    search.add_argument("--max-latency", type=number(above=0), default=None, metavar="SECONDS",
                        help="highest throughput whose block latency (prefill plus all decode steps of one block) "
                             "is at most SECONDS")
    search.add_argument("--pareto", action="store_true", help="also print the latency-throughput frontier")
    search.add_argument("--pareto-csv", default=None, metavar="FILE",
                        help="write the frontier as CSV (implies --pareto)")
    search.add_argument("--pareto-plot", default=None, metavar="FILE.png",
                        help="plot the frontier with matplotlib (implies --pareto)")
    search.add_argument("--output", "-o", default=None, metavar="FILE",
                        help="save the chosen policy as JSON for `flexoff run --policy FILE`")
    search.set_defaults(handler=run_search)

    profile = subparsers.add_parser(
        "profile", help="measure this machine's bandwidths, FLOPS and memory for the planner",
        description="Measure pinned copies, disk (O_DIRECT), matmuls at several row counts, attention and "
                    "dequantization, and save a hardware profile. Without CUDA the CPU is the compute device.",
    )
    profile.add_argument("--output", "-o", default=None, metavar="FILE",
                         help=f"where to save the profile (default {default_profile_path()}, "
                              "which `flexoff search` reads)")
    profile.add_argument("--quick", action="store_true",
                         help="smaller transfers and matmuls, each timed within its share of a budget of about 20 s "
                              "(10 s with CUDA)")
    profile.add_argument("--disk-dir", default=None, metavar="DIR",
                         help="directory on the disk that will hold offloaded tensors (default: the temp dir)")
    profile.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                         help="compute device to profile (default: cuda if available)")
    profile.set_defaults(handler=run_profile)


def _add_workload_args(search) -> None:
    """The job the search plans for."""
    search.add_argument("--prompts", metavar="FILE",
                        help="measure the job from a prompts file, read as `flexoff run --prompts` reads it, as "
                             "--policy auto plans it: its longest prompt (text through the model's tokenizer or "
                             "--tokenizer), each line's max_new_tokens (else --gen-len), its number of prompts and "
                             "the prefixes they share; instead of --prompt-len, --num-prompts, --shared-prefix and "
                             "--prefix-group")
    search.add_argument("--tokenizer", metavar="DIR", help="tokenizer for a --prompts file's text, if not the model's")
    search.add_argument("--prompt-len", type=COUNT, default=None,
                        help="prompt length in tokens, after padding (default 512)")
    search.add_argument("--gen-len", type=COUNT, default=32,
                        help="tokens generated per prompt (default 32; with --prompts, for lines that name none)")
    search.add_argument("--num-prompts", type=COUNT, default=None,
                        help="prompts in the job; blocks larger than it waste work (default: an endless stream)")
    search.add_argument("--shared-prefix", type=integer(0), default=None, metavar="N",
                        help="tokens at the start of each prompt that the rows of its GPU batch share (few-shot "
                             "examples, a system prompt), prefilled and stored once per GPU batch; below "
                             "--prompt-len (default 0: none)")
    search.add_argument("--prefix-group", type=integer(1), default=None, metavar="K",
                        help="prompts that share each prefix (12 questions of a 5-shot subject), so that a GPU "
                             "batch of more rows holds one prefix per group of K; needs --shared-prefix "
                             "(default: all of a GPU batch's rows share one)")


def run_search(args) -> int:
    # The flags' types (SIZE, SIZES) have already checked them.
    outputs = {"--output": args.output, "--pareto-csv": args.pareto_csv, "--pareto-plot": args.pareto_plot}
    check_outputs(args, outputs)
    for flag, path in outputs.items():
        if path:
            check_destination(path, flag)
    if args.pipeline_parallel > 1 or args.data_parallel > 1 or "," in (args.gpu_mem or ""):
        return _search_pipeline(args)
    sizes = [parse_size(size) if size else None for size in (args.gpu_mem, args.cpu_mem, args.disk_mem)]
    config = resolve_model_config(args.model)
    workload = _workload(args)
    hardware = resolve_hardware(args.hardware).with_memory(*sizes)
    options = dict(compress=args.compress, cpu_attention=args.cpu_attention)
    started = time.perf_counter()
    result = search_policy(config, workload, hardware, max_latency=args.max_latency, **options)
    print(format_prediction(result.prediction, title=(
        f"{config.name} on {describe_hardware(hardware)}: prompt {workload.prompt_len}"
        + _shared(workload) + f", {_generate(workload)}"
        + (f", {workload.num_prompts} prompts" if workload.num_prompts else "")
        + (f", block latency <= {args.max_latency:g} s" if args.max_latency else "")), stored=config.stored_compression))
    note = extrapolation_note(hardware, workload)
    if note:
        print(note)
    print(f"searched {result.candidates} candidates, solved {result.lps_solved} LPs "
          f"in {time.perf_counter() - started:.2f} s")
    if args.pareto or args.pareto_csv or args.pareto_plot:
        frontier = [r.prediction for r in pareto_frontier(config, workload, hardware, **options)]
        if args.max_latency is not None:
            frontier = [p for p in frontier if p.block_latency <= args.max_latency]
        print("\nlatency-throughput frontier")
        print(format_frontier(frontier))
        if args.pareto_csv:
            write_frontier_csv(frontier, args.pareto_csv)
            print(f"wrote {args.pareto_csv}")
        if args.pareto_plot:
            plot_frontier(frontier, args.pareto_plot, title=frontier_title(config.name, hardware, workload.prompt_len,
                                                                            workload.gen_len))
            print(f"wrote {args.pareto_plot}")
    if args.output:
        try:
            result.policy.save(args.output)
        except OSError as exc:
            raise ConfigError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        print(f"wrote {args.output}")
    return 0


def _shared(workload: Workload) -> str:
    """The prompts' mean length where they differ and their shared prefix, as the title names them
    ("" for neither)."""
    parts = [f"{workload.mean_prompt_len:.1f} on average"] if workload.mean_prompt_len else []
    if workload.shared_prefix:
        groups = f" by groups of {workload.prefix_group}" if workload.prefix_group else ""
        parts.append(f"{workload.shared_prefix} shared{groups}")
    return f" ({', '.join(parts)})" if parts else ""


def _workload(args) -> Workload:
    if args.prompts:
        return _measured_workload(args)
    if args.tokenizer:
        raise ConfigError("--tokenizer reads a --prompts file's text: give --prompts FILE too")
    prompt_len, shared = 512 if args.prompt_len is None else args.prompt_len, args.shared_prefix or 0
    if shared >= prompt_len:
        raise ConfigError(f"--shared-prefix {shared} must be below --prompt-len {prompt_len}: "
                          "every prompt keeps at least one token of its own")
    if args.prefix_group is not None and not shared:
        raise ConfigError(f"--prefix-group {args.prefix_group} needs --shared-prefix N: the prompts of a group "
                          "share N tokens")
    return Workload(prompt_len, args.gen_len, args.num_prompts, shared_prefix=shared,
                    prefix_group=args.prefix_group or 0)


def _measured_workload(args) -> Workload:
    """The job a prompts file holds, measured as ``--policy auto`` measures it (``prompt_workload``)."""
    from ..prompts import prompt_workload, read_prompts

    flags = {"--prompt-len": args.prompt_len, "--num-prompts": args.num_prompts,
             "--shared-prefix": args.shared_prefix, "--prefix-group": args.prefix_group}
    given = [flag for flag, value in flags.items() if value is not None]
    if given:
        raise ConfigError(f"{given[0]} describes the prompts that --prompts {args.prompts} measures: "
                          "give one or the other")
    lines = read_prompts(args.prompts)
    return prompt_workload([line.prompt if line.messages is None else line.messages for line in lines],
                           [line.max_new_tokens or args.gen_len for line in lines], args.model, args.tokenizer)


def _generate(workload: Workload) -> str:
    """The generation the title names: the budget, or where budgets differ their largest and mean."""
    if not workload.gen_lens:
        return f"generate {workload.gen_len}"
    return f"generate up to {workload.gen_len} ({sum(workload.gen_lens) / len(workload.gen_lens):.1f} on average)"


def _search_pipeline(args) -> int:
    """Each stage's plan of a pipeline over GPUs of one host (``planner.pipeline``)."""
    from ..job import stage_sizes
    from ..planner.pipeline import plan_pipeline, stage_hardware

    stages, replicas = args.pipeline_parallel, args.data_parallel
    gpu_sizes = stage_sizes(args.gpu_mem, stages)
    for flag, given in (("--max-latency", args.max_latency), ("--pareto", args.pareto or args.pareto_csv or
                                                                          args.pareto_plot), ("--output", args.output)):
        if given:
            raise ConfigError(f"{flag} plans one device; a pipeline's stages each have a policy of their own: "
                              "run the job with --policy auto, which plans them as here")
    config = resolve_model_config(args.model)
    workload = _workload(args)
    profile = resolve_hardware(args.hardware)
    processes = stages * replicas
    caps = [parse_size(size) if size else None for size in (args.cpu_mem, args.disk_mem)]
    gpu_caps = [parse_size(size) if size else None for size in gpu_sizes]
    hardware = stage_hardware(profile, gpu_caps, processes, *caps)
    started = time.perf_counter()
    plan = plan_pipeline(config, workload, hardware, replicas, compress=args.compress, cpu_attention=args.cpu_attention)
    print(format_pipeline_plan(plan, (
        f"{config.name} on {profile.name}: {stages} pipeline stages x {replicas} replica{'s' * (replicas > 1)}, "
        f"host memory{' and links' if profile.cpu_to_all_gpus_bandwidth else ''} shared by {processes} processes; "
        f"prompt {workload.prompt_len}{_shared(workload)}, {_generate(workload)}"
        + (f", {workload.num_prompts} prompts" if workload.num_prompts else ""))))
    print(_against_one_gpu(plan.throughput, config, workload, profile, gpu_caps, caps,
                           compress=args.compress, cpu_attention=args.cpu_attention))
    print(f"planned in {time.perf_counter() - started:.2f} s")
    return 0


def _against_one_gpu(throughput: float, config, workload: Workload, profile, gpu_caps: list, caps: list,
                     **options) -> str:
    """The plan beside one GPU (the largest cap, the host to itself): where the host's memory or
    links bound the job, more GPUs can run it slower, and the user should hear it before renting them."""
    largest = None if None in gpu_caps else max(gpu_caps)
    try:
        alone = search_policy(config, workload, profile.with_memory(largest, *caps), **options).prediction
    except PolicyError:
        return "one GPU  fits no policy under these caps: the job needs the pipeline"
    ratio = throughput / alone.total_throughput
    return (f"one GPU  {alone.total_throughput:.4g} token/s predicted ({policy_summary(alone.policy)}, the largest "
            f"cap, the host to itself): this plan is {ratio:.2f}x that"
            + ("; fewer GPUs run this job faster" if ratio < 1 else ""))


def run_profile(args) -> int:
    from ..profiler.machine import disk_measure_error, profile_machine  # imports torch; keep `flexoff search` light

    device = None if args.device == "auto" else args.device
    output = args.output or default_profile_path()
    check_outputs(args, {"--output": output})
    check_destination(output, "--output")  # before minutes of measuring, not after
    started = time.perf_counter()
    try:
        profile = profile_machine(quick=args.quick, disk_dir=args.disk_dir, device=device,
                                  log=lambda message: print(f"  {message}", flush=True))
    except OSError as exc:
        raise disk_measure_error(args.disk_dir, exc) from None
    try:
        profile.save(output)
    except OSError as exc:
        raise ConfigError(f"cannot write {output}: {exc.strerror or exc}") from None
    gb = 1e9
    print(f"{profile.device}")
    print(f"  cpu->gpu {profile.cpu_to_gpu_bandwidth / gb:.3g} GB/s, "
          f"gpu->cpu {profile.gpu_to_cpu_bandwidth / gb:.3g} GB/s, "
          f"disk read {profile.disk_to_cpu_bandwidth / gb:.3g} GB/s "
          f"({(profile.disk_to_cpu_cached_bandwidth or 0) / gb:.3g} from the page cache), "
          f"write {profile.cpu_to_disk_bandwidth / gb:.3g} GB/s")
    if profile.cpu_to_all_gpus_bandwidth is not None:
        print(f"  cpu->all {profile.gpu_count} GPUs at once {profile.cpu_to_all_gpus_bandwidth / gb:.3g} GB/s in all "
              f"({profile.sharing_links(profile.gpu_count).cpu_to_gpu_bandwidth / gb:.3g} GB/s each)")
    curve = ", ".join(f"m={m:g}: {f / 1e12:.3g}" for m, f in profile.matmul_flops)
    print(f"  matmul TFLOP/s {curve}")
    print(f"  attention prefill {profile.prefill_attention_flops / 1e12:.3g} TFLOP/s, decode "
          f"{profile.decode_attention_flops / 1e12:.3g}, cpu {profile.cpu_attention_flops / 1e9:.3g} GFLOP/s "
          f"({profile.cpu_attention_share_under_copy:.0%} of it while copies stream); "
          f"dequant {profile.gpu_dequant_throughput / 1e9:.3g} G elements/s "
          f"(KV rows {profile.kv_dequant_throughput / 1e9:.3g}; CPU {profile.cpu_dequant_throughput / 1e9:.3g}); "
          f"quantizing a prefill's cache {profile.kv_quant_throughput / 1e9:.3g} G elements/s")
    for rate in profile.sparse_mlp_flops:
        points = ", ".join(f"{t:g}: {f / 1e12:.3g}" for t, f in rate.points)
        print(f"  routed experts {'x'.join(map(str, rate.shape))} (hidden x width x experts x a token), "
              f"TFLOP/s by tokens routed together {points}")
    print(f"wrote {output} in {time.perf_counter() - started:.1f} s")
    return 0
