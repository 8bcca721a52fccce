"""flexoff against the published FlexGen 0.1.8 and HF Accelerate, same model and workload, in one run.

Each run is a separate process (bench/throughput_runs.py), so one that runs out of memory cannot take the
others down; its peak resident memory comes from the kernel's accounting of that process. Rows:
- flexoff at its own searched policy (--policy auto, with --compress and --hardware), its summary and the
  planner's predicted prefill / decode / total beside the measured ones;
- named policies (POLICIES, FlexGen's flags) run by both flexoff and FlexGen (--policies), or by FlexGen
  alone (--flexgen-policies); the best FlexGen policy is marked, one that fails is "cannot run: <why>";
- HF transformers + Accelerate with CPU offload at the largest batch that fits (--systems ...,hf);
- DeepSpeed ZeRO-Inference: ZeRO-3 with parameters on pinned host memory, 4-bit weights, the largest batch
  that fits (--systems ...,deepspeed; bench/deepspeed_driver.py names what it could not enable);
- llama.cpp's llama-batched-bench on a dummy Q4_0 GGUF, as much of it on the GPU as the cap holds, at each of
  --llamacpp-batch-sizes (--systems ...,llamacpp; bench/llamacpp.py says how it is placed and counted).
FlexGen runs OPT models only: for others its rows say so. --gpu-mem caps every system's GPU memory; --cpu-mem
caps flexoff's host memory. The decode roofline is the token/s a policy would reach if decode were bound only
by moving its bytes (off-GPU weights, a travelling cache) over the busiest link, PCIe or disk, at the packaged
H200 profile's measured bandwidths. The output ends with a markdown table for bench/RESULTS.md.

    python bench/throughput.py --model opt-30b --gpu-mem 16GiB --policy auto --systems flexoff,flexgen,hf \\
        --flexgen-policies "4-bit w+c w 0/100 cache-cpu 64x2,4-bit w+c w 0/100 cache-cpu 64x4" --offload-dir /tmp/o
    python bench/throughput.py --model mixtral-8x7b --gpu-mem 16GiB --policy auto --compress auto \\
        --systems flexoff,hf --offload-dir /tmp/o --timeout 900
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import llamacpp  # noqa: E402
from flexoff.models import REGISTRY  # noqa: E402
from flexoff.policy import CompressionConfig, Policy, placement_from_percent  # noqa: E402
from throughput_runs import run_flexgen, run_flexoff, run_flexoff_auto, run_hf, run_llamacpp  # noqa: E402
from throughput_runs import run_deepspeed  # noqa: E402

GiB = 2**30


def _all_on_cpu_4bit(gbs: int, ngb: int) -> dict:
    """4-bit weights and cache, all weights and the cache on the CPU, GPU attention."""
    return dict(percent=(0, 100, 0, 100, 100, 0), gbs=gbs, ngb=ngb, cpu_attention=False, compress_weight=True,
                compress_cache=True)


# percent = weights gpu/cpu, cache gpu/cpu, activations gpu/cpu (the rest on disk), as FlexGen's flag.
POLICIES = {
    "w50/50 cache-gpu 48x1": dict(percent=(50, 50, 100, 0, 100, 0), gbs=48, ngb=1, cpu_attention=False),
    "w0/100 cache-cpu cpu-attn 32x2": dict(percent=(0, 100, 0, 100, 100, 0), gbs=32, ngb=2, cpu_attention=True),
    "w20/60/20 cache-cpu cpu-attn 32x2": dict(percent=(20, 60, 0, 100, 100, 0), gbs=32, ngb=2,
                                             cpu_attention=True),
    # The paper's T4 policy shape, with the block cut to what 125 GiB of host memory holds.
    "16GiB w15/85 cache-cpu cpu-attn 24x3": dict(percent=(15, 85, 0, 100, 100, 0), gbs=24, ngb=3,
                                                cpu_attention=True, gpu_mem="16GiB"),
    "w0/100 cache-gpu 24x1": dict(percent=(0, 100, 100, 0, 100, 0), gbs=24, ngb=1, cpu_attention=False),
    # 4-bit group-wise compression (groups of 64), as FlexGen's --compress-weight/--compress-cache.
    "4-bit w 0/100 cache-gpu 64x1": dict(percent=(0, 100, 100, 0, 100, 0), gbs=64, ngb=1, cpu_attention=False,
                                        compress_weight=True),
    "4-bit w+c w 0/100 cache-cpu 64x2": dict(percent=(0, 100, 0, 100, 100, 0), gbs=64, ngb=2,
                                             cpu_attention=False, compress_weight=True, compress_cache=True),
    # The compressed policies' uncompressed twins, and CPU attention over the compressed cache.
    "w0/100 cache-gpu 64x1": dict(percent=(0, 100, 100, 0, 100, 0), gbs=64, ngb=1, cpu_attention=False),
    "w0/100 cache-cpu 64x2": dict(percent=(0, 100, 0, 100, 100, 0), gbs=64, ngb=2, cpu_attention=False),
    "4-bit w+c w 0/100 cache-cpu cpu-attn 64x2": dict(percent=(0, 100, 0, 100, 100, 0), gbs=64, ngb=2,
                                                      cpu_attention=True, compress_weight=True, compress_cache=True),
    # A FlexGen policy whose peak GPU use stays under 16 GiB, run by both under the same cap.
    "16GiB w0/100 cache-gpu 8x1": dict(percent=(0, 100, 100, 0, 100, 0), gbs=8, ngb=1, cpu_attention=False,
                                      gpu_mem="16GiB"),
    # FlexGen's policies under a 16 GiB cap (--gpu-mem 16GiB): 4-bit weights and cache, all weights and the
    # cache on the CPU, at the block sizes 125 GiB of host memory can hold for each model.
    **{f"4-bit w+c w 0/100 cache-cpu {gbs}x{ngb}": _all_on_cpu_4bit(gbs, ngb)
       for gbs, ngb in ((64, 4), (64, 8), (32, 2), (64, 3), (8, 2), (16, 2), (12, 3))},
}


def policy_of(spec: dict) -> Policy:
    four_bit = CompressionConfig(4, 64)
    return Policy(spec["gbs"], spec["ngb"], **placement_from_percent(spec["percent"]),
                  cpu_attention=spec["cpu_attention"],
                  compress_weight=four_bit if spec.get("compress_weight") else None,
                  compress_cache=four_bit if spec.get("compress_cache") else None)


def spec_of(policy: Policy) -> dict:
    """A policy as FlexGen's flags: whole percents (FlexGen takes integers), its 4-bit compression."""
    percent = []
    for part in ("weights", "cache", "activations"):
        gpu, cpu = (round(100 * share) for share in getattr(policy, part).as_tuple()[:2])
        percent += [gpu, min(cpu, 100 - gpu)]  # rounding must not put more than all of it on gpu and cpu
    return dict(percent=tuple(percent), gbs=policy.gpu_batch_size, ngb=policy.num_gpu_batches,
                cpu_attention=policy.cpu_attention, compress_weight=policy.compress_weight is not None,
                compress_cache=policy.compress_cache is not None)


def _decode_io(model: str, policy: Policy, prompt_len: int, gen_len: int):
    """Seconds per layer each link needs in a decode step (the cost model's byte counts, which follow the
    runtime's placement, at stored size, over the packaged H200 profile's measured bandwidths)."""
    from flexoff.planner.cost_model import CostModel, Placement, PolicyFrame, Workload
    from flexoff.planner.hardware import packaged_profile

    hw = packaged_profile("h200")
    cost = CostModel(REGISTRY[model], Workload(prompt_len, gen_len), hw)
    io, _ = cost.phase_terms(PolicyFrame.of(policy), Placement.of(policy, cost.config))["decode"]
    return hw, cost.num_layers, io


def roofline(model: str, policy: Policy, prompt_len: int, gen_len: int) -> float:
    """Decode token/s if each step only had to move its bytes over the busiest link (weights and a
    travelling cache over PCIe, disk pieces from disk), the links working side by side."""
    _, layers, io = _decode_io(model, policy, prompt_len, gen_len)
    seconds = layers * max(io["cpu_to_gpu"], io["disk_to_cpu"])
    return policy.block_size / seconds if seconds else float("inf")


def moved_bytes_per_token(model: str, policy: Policy, prompt_len: int, gen_len: int) -> float:
    """Bytes that cross PCIe or come from disk per generated token in decode, at stored size."""
    hw, layers, io = _decode_io(model, policy, prompt_len, gen_len)
    per_layer = (io["cpu_to_gpu"] * hw.cpu_to_gpu_bandwidth + io["gpu_to_cpu"] * hw.gpu_to_cpu_bandwidth
                 + io["disk_to_cpu"] * hw.disk_to_cpu_bandwidth)
    return per_layer * layers / policy.block_size


def hardware(args):
    """The profile the planner uses for --policy auto and the predictions, under the bench's caps."""
    from flexoff.planner.hardware import resolve_hardware
    from flexoff.units import parse_size

    caps = [parse_size(value) if value else None for value in (args.gpu_mem, args.cpu_mem)]
    return resolve_hardware(args.hardware).with_memory(*caps)


def predict(args, policy: Policy, num_prompts: int) -> dict:
    from flexoff.planner.cost_model import CostModel, Workload

    p = CostModel(REGISTRY[args.model], Workload(args.prompt_len, args.gen_len, num_prompts), hardware(args)) \
        .predict(policy)
    return {"prefill": p.prefill_throughput, "decode": p.decode_throughput, "total": p.total_throughput,
            "gpu_peak": p.peak_memory["gpu"], "cpu_peak": p.peak_memory["cpu"]}


def searched_policy(args) -> Policy:
    """The policy --policy auto finds for an endless stream of prompts. Running exactly one full block of it
    leaves the search's choice unchanged (no other policy gains from that) and wastes no padding."""
    from flexoff.planner.cost_model import Workload
    from flexoff.planner.search import search_policy

    workload = Workload(args.prompt_len, args.gen_len)
    return search_policy(REGISTRY[args.model], workload, hardware(args), compress=args.compress).policy


def row(system: str, label: str, result: dict, args, policy: Policy | None = None, num_prompts: int = 0) -> dict:
    entry = {"system": system, "policy": label, "result": result}
    if policy is not None:
        entry.update(roofline_decode=roofline(args.model, policy, args.prompt_len, args.gen_len),
                     moved_bytes_per_token=moved_bytes_per_token(args.model, policy, args.prompt_len, args.gen_len))
        if system == "flexoff":
            entry["predicted"] = predict(args, policy, num_prompts or policy.block_size)
    print(f"{label} · {system}: {result}", flush=True)
    return entry


def run_all(args) -> list[dict]:
    from flexoff.planner.report import policy_summary

    systems, rows = args.systems.split(","), []

    def in_workdir(runner, *extra):
        with tempfile.TemporaryDirectory() as workdir:
            return runner(*extra, args, Path(workdir))

    if args.policy == "auto" and "flexoff" in systems:
        planned = searched_policy(args)
        n = args.num_prompts or planned.block_size
        result = in_workdir(lambda a, w: run_flexoff_auto(a, w, n))
        # The policy that ran, as flexoff recorded it; the bench's own search where the run failed.
        policy = Policy.from_dict(result["policy"]) if "policy" in result else planned
        rows.append(row("flexoff", f"searched: {policy_summary(policy)}", result, args, policy, n))
        if args.flexgen_at_searched and "flexgen" in systems:
            spec = spec_of(policy)
            label = "flexoff's searched, as --percent " + " ".join(map(str, spec["percent"]))
            rows.append(row("flexgen", label, in_workdir(run_flexgen, spec), args, policy_of(spec)))
    for name in args.policies:
        spec = POLICIES[name]
        for system in ("flexoff", "flexgen"):
            if system in systems:
                runner = run_flexoff if system == "flexoff" else run_flexgen
                rows.append(row(system, name, in_workdir(runner, spec), args, policy_of(spec)))
    for name in args.flexgen_policies:
        rows.append(row("flexgen", name, in_workdir(run_flexgen, POLICIES[name]), args, policy_of(POLICIES[name])))
    if "hf" in systems:
        result = in_workdir(run_hf)
        label = f"device_map, batch {result['batch']}" if "batch" in result else "device_map"
        if result.get("experts"):
            label += f", experts {result['experts']}"
        rows.append(row("hf", label, result, args))
    if "deepspeed" in systems:
        result = in_workdir(run_deepspeed)
        label = f"ZeRO-3 offload, {result['weights']}, batch {result['batch']}" if "batch" in result else "ZeRO-3"
        rows.append(row("deepspeed", label, result, args))
    if "llamacpp" in systems:
        result = in_workdir(run_llamacpp)
        label = f"Q4_0, {result['flags']}, batch {result['batch']}" if "flags" in result else "Q4_0"
        rows.append(row("llamacpp", label, result, args))
    return rows


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}" if value < 10 else f"{value:.1f}"


def ok(entry: dict | None) -> bool:
    return bool(entry) and "error" not in entry["result"]


def best(rows: list[dict], system: str) -> dict | None:
    ran = [r for r in rows if r["system"] == system and ok(r)]
    return max(ran, key=lambda r: r["result"]["total"]) if ran else None


def table(rows: list[dict], args) -> str:
    """The markdown for bench/RESULTS.md: a heading, the provenance line, the rows, then the ratios."""
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        # Tracked files changed since that commit: the figures are not that commit's.
        if subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode:
            commit += " with local changes"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    caps = ", ".join(f"{flag} {value}" for flag, value in (("--gpu-mem", args.gpu_mem), ("--cpu-mem", args.cpu_mem))
                     if value)
    command = shlex.join(["python", "bench/throughput.py", *sys.argv[1:]])
    lines = [f"### {args.model.upper()}, dummy weights, prompt {args.prompt_len}, generate {args.gen_len}"
             + (f", {caps}" if caps else ""), "",
             f"{datetime.date.today()}, {card}, commit `{commit}`, `{command}`", "",
             "| system | policy | prefill | decode | total | predicted prefill / decode / total | peak GPU GiB "
             "| peak RSS GiB | decode / roofline | MB moved per token | note |",
             "|" + "---|" * 11]
    top = best(rows, "flexgen")
    for entry in rows:
        res, pred = entry["result"], entry.get("predicted")
        good = ok(entry)
        note = res["error"] if not good else ""
        if good and entry is top:
            note = "best FlexGen"
        if good and pred:
            note = f"measured / predicted total {res['total'] / pred['total']:.2f}"
        values = [fmt(res.get(k)) if good else "—" for k in ("prefill", "decode", "total")]
        roof = entry.get("roofline_decode")
        lines.append("| " + " | ".join([
            system_name(entry),
            entry["policy"], *values,
            " / ".join(fmt(pred[k]) for k in ("prefill", "decode", "total")) if pred else "—",
            f"{res['gpu_peak'] / GiB:.1f}" if good and res.get("gpu_peak") else "—",
            f"{res.get('rss', 0) / GiB:.1f}",
            f"{res['decode'] / roof:.0%}" if good and roof and roof != float("inf") else "—",
            f"{entry['moved_bytes_per_token'] / 1e6:.0f}" if "moved_bytes_per_token" in entry else "—",
            note]) + " |")
    return "\n".join(lines + [""] + ratio_lines(rows, top))


SYSTEMS = {"flexoff": "flexoff", "flexgen": "FlexGen 0.1.8", "hf": "HF Accelerate", "deepspeed": "DeepSpeed",
           "llamacpp": "llama.cpp"}


def system_name(entry: dict) -> str:
    name = SYSTEMS[entry["system"]]
    version = entry["result"].get("version")
    return f"{name} {version}" if version else name


def ratio_lines(rows: list[dict], top: dict | None) -> list[str]:
    """flexoff (the searched row, else its best) against FlexGen's best, each other system, the best of
    them, and FlexGen at the same policy."""
    searched = [r for r in rows if r["system"] == "flexoff" and r["policy"].startswith("searched")]
    ours = (searched[0] if searched and ok(searched[0]) else None) or best(rows, "flexoff")
    lines = []

    def ratio(a: dict, b: dict) -> str:
        return " · ".join(f"{k} {a['result'][k] / b['result'][k]:.2f}×" for k in ("prefill", "decode", "total"))

    if any(r["system"] == "flexgen" for r in rows):
        reasons = {r["result"]["error"] for r in rows if r["system"] == "flexgen" and not ok(r)}
        if top is None and len(reasons) == 1:
            lines.append(f"- FlexGen 0.1.8 {reasons.pop()}.")
        elif top is None:
            lines.append("- FlexGen 0.1.8 has no policy that runs here: every one tried cannot run (see the notes).")
        elif ours:
            lines.append(f"- flexoff ({ours['policy']}) / FlexGen's best ({top['policy']}): {ratio(ours, top)}")
    for other in (r for r in rows if r["system"] in ("hf", "deepspeed", "llamacpp")):
        name = SYSTEMS[other["system"]]
        if not ok(other):
            lines.append(f"- {name} {other['result']['error']}.")
        elif ours:
            lines.append(f"- flexoff ({ours['policy']}) / {name} ({other['policy']}): {ratio(ours, other)}")
    others = [r for r in rows if r["system"] != "flexoff" and ok(r)]
    if ours and others:
        rival = max(others, key=lambda r: r["result"]["total"])
        lines.append(f"- flexoff / the best other system ({system_name(rival)}, {rival['policy']}): "
                     f"total {ours['result']['total'] / rival['result']['total']:.2f}×")
    for mine in rows:
        twin = next((r for r in rows if r["system"] == "flexgen" and r["policy"] == mine["policy"]), None)
        if mine["system"] == "flexoff" and ok(mine) and twin and ok(twin):
            lines.append(f"- at {mine['policy']}, flexoff / FlexGen: {ratio(mine, twin)}")
    return lines


def names(text: str) -> list[str]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(map(repr, unknown))}; known: "
                                         + "; ".join(POLICIES))
    return chosen


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-30b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--systems", default="flexoff,flexgen",
                        help="comma-separated: " + ", ".join(SYSTEMS))
    parser.add_argument("--policy", choices=["auto"], help="auto: a flexoff row at the policy flexoff searches")
    parser.add_argument("--hardware", default="h100", metavar="NAME|FILE",
                        help="the planner's profile for --policy auto and the predictions (default h100), or a "
                             "file from `flexoff profile --output` measured in the same session")
    parser.add_argument("--compress", choices=["off", "auto", "on"], default="auto",
                        help="flexoff's --compress for --policy auto (default auto)")
    parser.add_argument("--num-prompts", type=int,
                        help="prompts of the --policy auto run (default: one block of the searched policy)")
    parser.add_argument("--policies", type=names, help="named policies (from POLICIES) run by flexoff and FlexGen; "
                                                       "default: all of them, unless --policy auto or "
                                                       "--flexgen-policies is given")
    parser.add_argument("--flexgen-policies", type=names, default=[], help="named policies run by FlexGen only")
    parser.add_argument("--flexgen-at-searched", action="store_true",
                        help="with --policy auto, FlexGen also runs flexoff's searched policy (whole percents)")
    parser.add_argument("--gpu-mem", metavar="SIZE", help="GPU memory cap of every system, e.g. 16GiB")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="flexoff's decode layers without CUDA graphs")
    parser.add_argument("--cpu-mem", metavar="SIZE", help="flexoff's host memory cap, e.g. 64GiB")
    parser.add_argument("--dtype", default="auto", help="flexoff's --dtype (on a CPU, float16 or bfloat16 for auto)")
    parser.add_argument("--hf-batch-sizes", help="batch sizes HF tries, largest first (default: from its estimate)")
    parser.add_argument("--hf-experts", help="HF's experts kernel (transformers 5), e.g. eager (default: its own)")
    parser.add_argument("--deepspeed-quant-bits", type=int, choices=[0, 4, 8], default=4,
                        help="DeepSpeed's weight bits at initialization, 0 for 16-bit (default 4)")
    parser.add_argument("--deepspeed-batch-sizes", help="batch sizes DeepSpeed tries, largest first "
                                                        "(default: from its estimate)")
    parser.add_argument("--llamacpp-bin", help=f"llama.cpp's llama-batched-bench (default: ${llamacpp.BINARY_ENV}, "
                                                "else PATH)")
    parser.add_argument("--llamacpp-batch-sizes", type=sizes, default=[64, 32, 16],
                        help="parallel sequences llama.cpp runs, one run each (default 64,32,16)")
    parser.add_argument("--llamacpp-ubatch", type=int, default=llamacpp.UBATCH,
                        help=f"llama.cpp's tokens per micro-batch, -b and -ub (default {llamacpp.UBATCH})")
    parser.add_argument("--offload-dir", default=tempfile.gettempdir(),
                        help="offload files, and llama.cpp's dummy GGUF (kept for later runs)")
    parser.add_argument("--timeout", type=int, default=480, help="seconds per run")
    parser.add_argument("--flexgen-fewer-batch", action="store_true",
                        help="FlexGen's own projection from a partial run (--debug-mode fewer_batch)")
    parser.add_argument("--json", help="write all results here")
    args = parser.parse_args(argv)
    if args.policies is None:
        args.policies = [] if args.policy or args.flexgen_policies else list(POLICIES)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        fail(f"--systems: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    if "deepspeed" in args.systems.split(",") and importlib.util.find_spec("deepspeed") is None:
        fail("--systems deepspeed: the deepspeed package is not installed; DS_BUILD_OPS=0 pip install deepspeed "
             "--no-build-isolation (it needs torch installed first)")
    if "llamacpp" in args.systems.split(","):
        try:
            llamacpp.find_binary(args.llamacpp_bin)
        except llamacpp.Missing as err:
            fail(f"--systems llamacpp: {err}")
    return args


def fail(message: str) -> None:
    """A user's mistake: one line, exit code 2."""
    print(f"throughput.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def sizes(text: str) -> list[int]:
    try:
        chosen = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of whole numbers: {text!r}") from None
    if not chosen or min(chosen) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be 1 or more: {text!r}")
    return chosen


def main() -> None:
    args = parse_args()
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"# {args.model}, prompt {args.prompt_len}, generate {args.gen_len}, on {card}", flush=True)
    rows = run_all(args)
    print("\n" + table(rows, args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
