"""Cost model against reality: predicted vs measured throughput and peak memory.

Policies of OPT-30B, OPT-66B and OPT-175B, and of the mixtures of experts Mixtral-8x7B and
Qwen3-30B-A3B, searched and hand-made, on the full card and under `--gpu-mem` caps of 16 and
24 GiB (the commodity-card regime, most of them 4-bit): predict
throughput (prefill, decode, total) and peak memory per tier with the planner, then run each with
dummy weights through ``flexoff.LLM(...).generate`` in its own process (an out-of-memory or a
timeout leaves the others alone) under the same caps, and print predicted vs measured.

Targets: throughput within +-15%, peak GPU and CPU memory within +-10%, for every searched policy;
and each searched 16 GiB policy within 10% of the best measured of its grid (``--grid``).

    python bench/cost_model_accuracy.py --predict-only                 # every prediction, anywhere
    python bench/cost_model_accuracy.py --measure-profile --warmup --only "opt-30b gpu 16GiB searched"
    python bench/cost_model_accuracy.py --grid "opt-30b gpu 16GiB searched, compress auto" --predict-only
    python bench/cost_model_accuracy.py --measure-profile --warmup --only mixtral-8x7b --only qwen3-30b-a3b
    python bench/cost_model_accuracy.py --measure-profile --warmup --set families --gen-len 256
    python bench/cost_model_accuracy.py --report a.json b.json         # one table from several calls

A grid run generates --grid-gen-len tokens (default 8) for one block. --grid-part K/N splits a grid
over several calls, each measuring the searched policy as its yardstick; --grid-skip leaves out
steps predicted to run long (CPU attention at the 16 GiB cap runs for minutes).

Machines of one kind differ by 15-25%: ``--measure-profile`` measures this machine's profile first
(`flexoff profile`, in a child process) and predicts (and searches) every case with it.

CPU memory is measured as the child's peak resident set less its resident set just before the
model is built (Python, torch and the CUDA context are not the model's).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.calibration import report  # noqa: E402
from bench.calibration import repredict  # noqa: E402
from bench.calibration.cases import CASES, SETS, resolve, select  # noqa: E402
from bench.calibration.grid import neighbours  # noqa: E402
from bench.calibration.runner import device_info, measure, measure_profile  # noqa: E402
from flexoff.errors import FlexoffError  # noqa: E402
from flexoff.models import REGISTRY  # noqa: E402
from flexoff.planner.cost_model import CostModel, Workload  # noqa: E402
from flexoff.planner.hardware import HardwareProfile, resolve_hardware  # noqa: E402
from flexoff.planner.report import policy_summary  # noqa: E402


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" (modified)" if dirty else "")


def _prediction(model: str, policy, hardware, prompt_len: int, gen_len: int, num_prompts: int) -> dict:
    predicted = CostModel(REGISTRY[model], Workload(prompt_len, gen_len, num_prompts), hardware).predict(policy)
    return {"total_throughput": predicted.total_throughput, "prefill_throughput": predicted.prefill_throughput,
            "decode_throughput": predicted.decode_throughput, "block_latency": predicted.block_latency,
            **predicted.peak_memory, "fits": predicted.fits,
            "prefill_bound": predicted.prefill.bound, "decode_bound": predicted.decode.bound}


def _record(case, policy, hardware, args, gen_len: int, num_prompts: int, workdir: Path, **extra) -> dict:
    """Predict one run, measure it unless predicting only, and return its record."""
    predicted = _prediction(case.model, policy, hardware, args.prompt_len, gen_len, num_prompts)
    measured = {}
    if not args.predict_only:
        measured = measure(case.model, policy, prompt_len=args.prompt_len, gen_len=gen_len, num_prompts=num_prompts,
                           gpu_mem=case.gpu_mem, cpu_mem=case.cpu_mem, offload_dir=args.offload_dir,
                           warmup=args.warmup, timeout=args.timeout, workdir=workdir)
    return {"name": case.name, "model": case.model, "searched": case.searched, "held_out": case.held_out,
            "gpu_mem": case.gpu_mem,
            "cpu_mem": case.cpu_mem, "compress": case.compress, "policy": policy.to_dict(),
            "summary": policy_summary(policy),
            "workload": {"prompt_len": args.prompt_len, "gen_len": gen_len, "num_prompts": num_prompts},
            "predicted": predicted, "measured": measured, **extra}


class Output:
    """What the call prints at the end and keeps in --json (rewritten after every run, so that a
    call cut short keeps what it measured)."""

    def __init__(self, args, card, profile: HardwareProfile):
        self.path, self.records = args.json, []
        self.head = {"card": card, "date": time.strftime("%Y-%m-%d %H:%M"), "commit": _commit(),
                     "command": shlex.join(["python", "bench/cost_model_accuracy.py", *sys.argv[1:]]),
                     "profile": f"{profile.name} ({profile.source})", "hardware": profile.to_dict()}

    def add(self, record: dict) -> None:
        self.records.append(record)
        if self.path:
            Path(self.path).write_text(json.dumps({**self.head, "records": self.records}, indent=2))

    def preamble(self) -> list[str]:
        h = self.head
        return report.preamble(h["card"], h["date"], h["commit"], h["command"], h["profile"])


def run_cases(args, profile: HardwareProfile, output: Output, workdir: Path) -> int:
    workload = Workload(args.prompt_len, args.gen_len)
    if not args.predict_only:
        print(report.CASE_HEADER)
        print(report.separator(report.CASE_HEADER), flush=True)
    for spec in select(SETS[args.set], args.only):
        try:
            case = resolve(spec, profile, workload)
        except FlexoffError as exc:  # the search finds nothing under these caps
            print(f"| {spec.name} | no policy: {exc} |", flush=True)
            continue
        num_prompts = case.policy.block_size * args.blocks
        record = _record(case, case.policy, case.hardware(profile), args, args.gen_len, num_prompts, workdir)
        output.add(record)
        if not args.predict_only:
            print(report.case_row(record), flush=True)
    print("\n" + "\n".join(output.preamble()))
    print(report.CASE_HEADER)
    print(report.separator(report.CASE_HEADER))
    for record in output.records:
        print(report.case_row(record))
    if not args.predict_only:
        print("\n" + "\n".join(report.summaries(output.records)))
    failed = [r["name"] for r in output.records if r["searched"] and "error" in r["measured"]]
    if failed:
        print(f"searched policies that failed: {', '.join(failed)}")
        return 1
    return 0


def _part(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--grid-part takes K/N, got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--grid-part K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def run_grid(args, profile: HardwareProfile, output: Output, workdir: Path) -> int:
    specs = [s for s in select(CASES, [args.grid]) if s.searched]
    if len(specs) != 1:
        names = ", ".join(s.name for s in specs) or "none"
        print(f"--grid {args.grid!r} must name one searched case (matches: {names})", file=sys.stderr)
        return 2
    workload = Workload(args.prompt_len, args.gen_len)
    case = resolve(specs[0], profile, workload)
    hardware = case.hardware(profile)
    fitting, rejected = neighbours(case.policy, REGISTRY[case.model], workload, hardware, tuple(args.grid_skip or ()))
    print(f"grid of {case.name}: {policy_summary(case.policy)}")
    print(f"{len(fitting)} neighbours fit; not fitting: "
          + ("; ".join(f"{n.label} ({policy_summary(n.policy)})" for n in rejected) or "none"))
    k, n = args.grid_part
    chosen = [nb for nb in fitting if not args.grid_step or any(text in nb.label for text in args.grid_step)]
    runs = [("searched", case.policy)] + [(nb.label, nb.policy) for nb in chosen][k - 1::n]
    part = f"{k}/{n} {output.head['date']}"
    header = report.GRID_HEADER
    if not args.predict_only:
        print(header)
        print(report.separator(header), flush=True)
    for label, policy in runs:
        search_workload = CostModel(REGISTRY[case.model], Workload(args.prompt_len, args.gen_len, policy.block_size),
                                    hardware).predict(policy).total_throughput
        record = _record(case, policy, hardware, args, args.grid_gen_len, policy.block_size, workdir,
                         grid=case.name, label=label, part=part, predicted_search_workload=search_workload)
        output.add(record)
        if not args.predict_only:
            print(report.grid_rows([record])[0][0], flush=True)
    rows, verdict = report.grid_rows(output.records)
    print("\n" + "\n".join(output.preamble()))
    print(f"grid of {case.name} (prompt {args.prompt_len}, generate {args.grid_gen_len}, one block each; "
          f"\"pred at search workload\" is for generate {args.gen_len})\n")
    print(header)
    print(report.separator(header))
    print("\n".join(rows))
    print("\n" + verdict)
    return 0


def print_report(files: list[str]) -> int:
    """One table (and one summary, one verdict per grid) from the --json files of several calls."""
    cases, grids = [], {}
    for name in files:
        data = json.loads(Path(name).read_text())
        print(f"{name}: card {data['card']}, {data['date']}, commit {data['commit']}, profile {data['profile']}")
        print(f"  {data['command']}")
        for record in data["records"]:
            (grids.setdefault(record["grid"], []) if "grid" in record else cases).append(record)
    if cases:
        print("\n" + report.CASE_HEADER + "\n" + report.separator(report.CASE_HEADER))
        print("\n".join(report.case_row(r) for r in cases))
        print("\n" + "\n".join(report.summaries(cases)))
    for grid, records in grids.items():
        rows, verdict = report.grid_rows(records)
        print(f"\ngrid of {grid}\n\n{report.GRID_HEADER}\n{report.separator(report.GRID_HEADER)}")
        print("\n".join(rows) + "\n\n" + verdict)
    return 0


def print_repredicted(files: list[str], name: str, fields: list[str] | None, parser) -> int:
    other = resolve_hardware(name)
    # By default the GPU rates the other profile has: an older one may lack the newer figures.
    fields = fields or repredict.present(other, repredict.GPU_RATES)
    print(f"\nre-predicted with {', '.join(fields)} from {other.name} ({other.source})\n")
    print(repredict.HEADER + "\n" + report.separator(repredict.HEADER))
    for file in files:
        try:
            print("\n".join(repredict.rows(json.loads(Path(file).read_text()), other, fields)))
        except ValueError as exc:
            parser.error(str(exc))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="h100", help="packaged profile name or profile JSON (default h100)")
    parser.add_argument("--measure-profile", action="store_true",
                        help="measure this machine's profile first (as `flexoff profile`) and predict with it")
    parser.add_argument("--quick-profile", action="store_true", help="with --measure-profile: `flexoff profile "
                                                                     "--quick` (tens of seconds)")
    parser.add_argument("--profile-output", default=None, metavar="FILE",
                        help="where --measure-profile saves the profile (default: beside --json, else the temp dir)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1, help="blocks to generate per policy (default 1)")
    parser.add_argument("--predict-only", action="store_true", help="skip the runs (the default without CUDA)")
    parser.add_argument("--warmup", action="store_true", help="a 2-token generation before the timed one")
    parser.add_argument("--set", choices=sorted(SETS), default="all",
                        help="the cases to run: all, or families (today's models searched under 16 and 24 GiB; "
                             "Qwen3-32B held out of the calibration)")
    parser.add_argument("--only", action="append", help="run only the case of this name, or else those whose name "
                                                        "contains it (repeatable)")
    parser.add_argument("--timeout", type=float, default=540, help="seconds a run may take, model build included "
                        "(default 540); one that has written its results has two minutes more to exit")
    parser.add_argument("--grid", default=None, metavar="NAME",
                        help="run the searched case NAME and its neighbours one step away instead of the cases")
    parser.add_argument("--grid-gen-len", type=int, default=8, help="tokens each grid run generates (default 8)")
    parser.add_argument("--grid-part", type=_part, default=(1, 1), metavar="K/N",
                        help="run the searched policy and every N-th neighbour from the K-th (default 1/1: all)")
    parser.add_argument("--grid-skip", action="append", metavar="TEXT",
                        help="leave out the steps whose label contains TEXT, before the grid is filled to "
                             "six neighbours (repeatable)")
    parser.add_argument("--grid-step", action="append", metavar="TEXT",
                        help="measure only the neighbours whose label contains TEXT, after the grid is built "
                             "(repeatable; completes a grid cut short, beside the searched policy)")
    parser.add_argument("--offload-dir", default=os.environ.get("FLEXOFF_OFFLOAD_DIR", tempfile.gettempdir()),
                        help="disk tier directory (default $FLEXOFF_OFFLOAD_DIR or the temp dir)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write every prediction and measurement")
    parser.add_argument("--report", nargs="+", metavar="FILE", help="print the tables of earlier --json files")
    parser.add_argument("--repredict", metavar="PROFILE",
                        help="with --report: predict the recorded runs again with this profile's figures (packaged "
                             "name or JSON) in place of the recorded profile's: those of --repredict-field, or its "
                             "GPU kernel rates")
    parser.add_argument("--repredict-field", action="append", metavar="SECTION.KEY",
                        help="a figure to take from --repredict's profile, e.g. compute.matmul_flop_per_s (repeatable)")
    args = parser.parse_args()
    if args.repredict and not args.report:
        parser.error("--repredict needs --report FILE...")
    if args.report:
        code = print_report(args.report)
        if args.repredict:
            code = print_repredicted(args.report, args.repredict, args.repredict_field, parser)
        return code

    card = None
    if not args.predict_only:
        info = device_info()
        if not info["cuda"]:
            print("no CUDA here: predictions only")
            args.predict_only = True
        card = info["card"]
    if args.measure_profile:
        default = Path(args.json).with_suffix(".profile.json") if args.json else \
            Path(tempfile.gettempdir()) / f"flexoff-profile-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path = Path(args.profile_output) if args.profile_output else default
        measure_profile(path, args.offload_dir, args.quick_profile, args.timeout)
        profile = HardwareProfile.load(path)
    else:
        profile = resolve_hardware(args.hardware)
    print(f"card: {card or 'none'}; profile: {profile.name} ({profile.source})", flush=True)
    output = Output(args, card, profile)
    with tempfile.TemporaryDirectory() as tmp:
        if args.grid:
            return run_grid(args, profile, output, Path(tmp))
        return run_cases(args, profile, output, Path(tmp))


if __name__ == "__main__":
    raise SystemExit(main())
