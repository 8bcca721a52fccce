"""The flags commands share, flag types that check values at parse time, a parser whose errors are
one line, and the Job the flags describe.

Each type turns a flag's text into its value or refuses it with the rule it breaks; argparse adds
the flag's name ("argument --top-p: must be a number in (0, 1], got 1.5").
"""

from __future__ import annotations

import argparse
import math

from ..checks import MAX_SEED, check_device_name, check_size, in_range, requirement
from ..errors import FlexoffError
from ..job import DEFAULT_MODEL, MAX_PARALLEL_TIMEOUT_S, POLICY_FLAGS, Job, PolicySource, check_dtype_name
from ..policy import CHOICES, SUPPORTED_BITS, CompressionConfig


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, ``flexoff: error: ...``, and exit code 2
    (argparse's own print the usage first). Subcommand parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"flexoff: error: {message} (see `{self.prog} --help`)\n")


def integer(minimum: int | None = None, maximum: int | None = None):
    need = requirement("an integer", minimum, maximum)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {need}, got {text!r}") from None
        if not in_range(value, minimum, maximum):
            raise argparse.ArgumentTypeError(f"must be {need}, got {value}")
        return value

    return parse


def number(minimum: float | None = None, maximum: float | None = None, above: float | None = None):
    """A finite float in range (NaN and infinity are refused)."""
    need = requirement("a number", minimum, maximum, above)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {need}, got {text!r}") from None
        if not math.isfinite(value) or not in_range(value, minimum, maximum, above):
            raise argparse.ArgumentTypeError(f"must be {need}, got {text}")
        return value

    return parse


def _checked(check):
    """A flag type from a check that raises FlexoffError; the check returns the flag's value."""

    def parse(text: str):
        try:
            return check(text)
        except FlexoffError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _size(text: str) -> str:
    return check_size(text)  # kept as text: consumers parse it, as they parse sizes given in Python


def _sizes(text: str) -> str:
    """One size, or several separated by commas (one per pipeline stage)."""
    for size in text.split(","):
        check_size(size.strip())
    return text


def _text(text: str) -> str:
    if not text:
        raise FlexoffError("must not be empty")
    return text


DEFAULT_BITS, DEFAULT_GROUP = 4, 64  # --weight-bits/--cache-bits and their group sizes, when not given
COUNT = integer(1)  # a positive count: prompts, tokens, batch sizes, instances
SEED = integer(0, MAX_SEED)
SIZE = _checked(_size)
SIZES = _checked(_sizes)
NONEMPTY = _checked(_text)
DEVICE = _checked(check_device_name)
DTYPE = _checked(check_dtype_name)


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
                       help="float16, bfloat16, float32, or auto (on CUDA the model's own 16-bit format, as its "
                            "config.json says: bfloat16 for Llama 3, Mistral, Qwen and Mixtral, else float16; "
                            "float32 on CPU)")
    group.add_argument("--device", default="auto", type=DEVICE, help="compute device: cuda, cuda:N, cpu, or auto")
    group.add_argument("--tokenizer", help="directory with tokenizer files, if not the checkpoint's")


def add_compress_arg(group, default: str | None) -> None:
    """``--compress``: what planning may do with lossy 4-bit compression (the same flag on every
    command that plans, so that they plan alike)."""
    group.add_argument("--compress", choices=CHOICES, default=default,
                       help="4-bit group-wise compression of weights and KV cache when planning: never (off, the "
                            "default: planning is lossless), try both (auto), always (on); compression changes "
                            "the outputs. A model whose checkpoint stores its matrices compressed (a GGUF's "
                            "Q4_0, Q8_0) is always planned with them as stored, and this flag decides the KV "
                            "cache's compression alone")


def add_policy_args(parser: argparse.ArgumentParser, planning: bool = True):
    """The policy flags, in the group it returns; ``planning`` adds --compress, for commands that
    plan a policy for their job."""
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
    group.add_argument("--expert-percent", type=number(0, 100), nargs=2, metavar=("E_GPU", "E_CPU"),
                       help="percent of a mixture of experts' expert weights on gpu and cpu, the rest on disk "
                            "(default: as the weights); each expert stays whole")
    group.add_argument("--gpu-batch-size", type=COUNT, help="sequences per GPU batch")
    group.add_argument("--num-gpu-batches", type=COUNT, help="GPU batches per block (they share one weight load)")
    group.add_argument("--cpu-attention", action="store_true", default=None,
                       help="run decode attention on the CPU for cache rows held off the GPU")
    group.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                       help="run loads, stores and compute one after another (for measuring)")
    group.add_argument("--no-pin", dest="pin_cpu_memory", action="store_false", default=None,
                       help="do not pin host memory (slower copies, but no page-locked RAM)")
    if planning:
        add_compress_arg(group, None)  # None: not given, so --compress-weight alone does not contradict it
    group.add_argument("--compress-weight", action="store_true", default=None,
                       help="store weights 4-bit group-quantized on every tier (dequantized on the GPU before use)")
    # The compression settings default to None, so that one given without its --compress-* flag is told apart.
    group.add_argument("--weight-bits", type=int, choices=SUPPORTED_BITS,
                       help=f"bits per weight with --compress-weight (2, 3, 4 or 8; default {DEFAULT_BITS})")
    group.add_argument("--weight-group", type=integer(2),
                       help=f"group size for weight compression (>= 2; default {DEFAULT_GROUP})")
    group.add_argument("--compress-cache", action="store_true", default=None,
                       help="store the KV cache group-quantized on every tier")
    group.add_argument("--cache-bits", type=int, choices=SUPPORTED_BITS,
                       help=f"bits per cache value with --compress-cache (2, 3, 4 or 8; default {DEFAULT_BITS})")
    group.add_argument("--cache-group", type=integer(2),
                       help=f"group size for cache compression (>= 2; default {DEFAULT_GROUP})")
    group.add_argument("--offload-dir", help="directory for the disk tier (default: $FLEXOFF_OFFLOAD_DIR, else the "
                                             "system's temporary folder); flexoff makes a private folder inside it "
                                             "and removes it on exit")
    group.add_argument("--gpu-mem", metavar="SIZE", type=SIZES,
                       help="cap flexoff's GPU memory, e.g. 16GiB (emulates a smaller card); with --pipeline-parallel, "
                            "one size for every GPU or one per stage, e.g. 16GiB,24GiB")
    group.add_argument("--cpu-mem", metavar="SIZE", type=SIZE, help="cap flexoff's host memory, e.g. 200GiB")
    return group


def add_runtime_switches(group) -> None:
    """``--no-prefix-sharing`` and ``--no-cuda-graphs``, the same on every command that generates."""
    group.add_argument("--no-prefix-sharing", dest="prefix_sharing", action="store_false",
                       help="prefill and cache every prompt whole, even where prompts begin alike (by default "
                            "rows sharing a long prefix run in one GPU batch, which prefills it once and keeps one "
                            "copy of its KV cache; the outputs are the same)")
    group.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                       help="enqueue every decode layer's kernels one by one (by default, on CUDA, the halves of a "
                            "decode layer around attention replay as CUDA graphs; the outputs are the same)")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "parallel", "One job over several processes, one per GPU (gloo between CPUs). Alone, flexoff starts "
                    "them on this host through torch.distributed.run; under torchrun (several hosts: "
                    "--nnodes, --rdzv-endpoint) each process is one of the launch's.")
    group.add_argument("--pipeline-parallel", type=COUNT, metavar="N",
                       help="split the model's layers between N pipeline stages, each on its own GPU "
                            "(default: as many as the launch has processes, over the replicas)")
    group.add_argument("--data-parallel", type=COUNT, metavar="M",
                       help="M replicas of the pipeline, each generating its share of the blocks (default 1)")
    parser.set_defaults(launches=True)  # the command starts a parallel job's processes when alone
    group.add_argument("--parallel-timeout", type=number(above=0, maximum=MAX_PARALLEL_TIMEOUT_S), metavar="SECONDS",
                       help="how long a process waits for its peers before the job ends (default 600)")


def add_quiet_arg(group) -> None:
    """``--quiet``, the same on every command that shows a progress bar (``--no-progress`` is its
    older spelling on ``batch`` and ``bench``, kept for the scripts that use it)."""
    group.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bar on stderr")


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


def _compression(args, part: str) -> CompressionConfig | None:
    """--compress-weight or --compress-cache with its bits and group size; None when not given."""
    if not getattr(args, f"compress_{part}", None):
        return None
    bits, group = getattr(args, f"{part}_bits"), getattr(args, f"{part}_group")
    return CompressionConfig(DEFAULT_BITS if bits is None else bits, DEFAULT_GROUP if group is None else group)


def job_from_args(args) -> Job:
    """The job the model, policy and sampling flags describe (those a command lacks keep Job's defaults).
    Without --model the job runs the default model with dummy weights."""
    model, dummy = (args.model, args.dummy) if args.model else (DEFAULT_MODEL, True)
    flag = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    policy = PolicySource.build(
        flag("policy"), flag("hardware"), percent=flag("percent"), expert_percent=flag("expert_percent"),
        compress_weight=_compression(args, "weight"), compress_cache=_compression(args, "cache"),
        compress=flag("compress"), gpu_batch_size=flag("gpu_batch_size"), num_gpu_batches=flag("num_gpu_batches"),
        cpu_attention=flag("cpu_attention"), overlap=flag("overlap"), pin_cpu_memory=flag("pin_cpu_memory"))
    return Job(model=model, dummy=dummy, dtype=args.dtype, device=args.device, tokenizer=args.tokenizer,
               seed=args.seed, policy=policy, temperature=flag("temperature", 0.0), top_k=flag("top_k", 0),
               top_p=flag("top_p", 1.0), stop=tuple(flag("stop", ())), ignore_eos=flag("ignore_eos", False),
               offload_dir=flag("offload_dir"), gpu_mem=flag("gpu_mem"), cpu_mem=flag("cpu_mem"),
               pipeline_parallel=flag("pipeline_parallel"), data_parallel=flag("data_parallel"),
               parallel_timeout=flag("parallel_timeout"), prefix_sharing=flag("prefix_sharing", True),
               cuda_graphs=flag("cuda_graphs", True))


def unused_flags(args, llm) -> list[str]:
    """One line for each flag given that has no effect on this job, which runs as it would without
    it: the user meant something by it, so it is named rather than dropped in silence."""
    flag = lambda name: getattr(args, name, None)  # noqa: E731
    lines = []
    if flag("expert_percent") and not llm.config.num_experts:
        lines.append(f"--expert-percent has no effect: {llm.config.name} has no experts (it is not a mixture of "
                     "experts); --percent places its weights")
    planned = flag("policy") == "auto" or (llm.plan is not None and llm.plan.search is not None)
    if flag("compress") in ("auto", "on") and not planned:
        placing = ("percent", "expert_percent", "compress_weight", "compress_cache", *POLICY_FLAGS)
        placed = any(flag(name) is not None for name in placing)
        given = (f"the policy comes from {args.policy}" if flag("policy") else
                 "the policy flags set the policy" if placed else "the job fits the device as it is")
        lines.append(f"--compress {args.compress} has no effect: it applies to planning, and nothing was planned "
                     f"({given}); --compress-weight and --compress-cache compress any policy")
    for part in ("weight", "cache"):
        given = [f"--{part}-{what}" for what in ("bits", "group") if flag(f"{part}_{what}") is not None]
        if given and not flag(f"compress_{part}"):
            lines.append(f"{' and '.join(given)} {'have' if len(given) > 1 else 'has'} no effect without "
                         f"--compress-{part}")
    if flag("parallel_timeout") is not None and llm.ranks is None:
        lines.append("--parallel-timeout has no effect: this job runs in one process (see --pipeline-parallel "
                     "and --data-parallel)")
    return lines
