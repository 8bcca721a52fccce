"""flexoff against the published FlexGen package, same model, workload and policies, in one run.

Each run is a separate process, so one that runs out of memory cannot take the others down; its
peak resident memory comes from the kernel's accounting of that process. For each policy the table
gives prefill / decode / total token/s of both systems, their ratio, peak memory, and the decode
roofline: the token/s the policy would reach if decode were bound only by streaming its
off-GPU weights over PCIe (and disk) at the measured bandwidths.

    python bench/throughput.py --model opt-30b --systems flexoff,flexgen --offload-dir /tmp/offload
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flexoff.models import REGISTRY, stage_specs, stages  # noqa: E402
from flexoff.layout import place_stage  # noqa: E402
from flexoff.policy import placement_from_percent  # noqa: E402

# Measured on the lent H100 machine (shared/reference/anchors.md): pinned host->GPU copy and
# O_DIRECT disk reads.
H2D_BANDWIDTH = 55.3e9
DISK_READ_BANDWIDTH = 1.9e9

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
}


def roofline(model: str, spec: dict, gen_len: int, itemsize: int = 2) -> float:
    """Decode token/s if each step only had to stream the off-GPU weights once (4.5 bits a value
    when compressed in groups of 64)."""
    cfg = REGISTRY[model]
    w = placement_from_percent(spec["percent"])["weights"]
    on = {"cpu": 0, "disk": 0}
    for stage in stages(cfg):
        for placement in place_stage(stage_specs(cfg, stage), w):
            for tier in on:
                on[tier] += placement.numel_on(tier) * itemsize
    shrink = 4.5 / 16 if spec.get("compress_weight") else 1.0
    seconds = shrink * (on["cpu"] / H2D_BANDWIDTH + on["disk"] / DISK_READ_BANDWIDTH)
    return spec["gbs"] * spec["ngb"] / seconds if seconds else float("inf")


def moved_bytes_per_token(model: str, spec: dict, prompt_len: int, gen_len: int) -> float:
    """Bytes that cross PCIe or come from disk per generated token in decode, at stored size (compressed
    where the policy compresses): the cost model's byte counts, which follow the runtime's placement."""
    from flexoff.planner.cost_model import CostModel, Placement, PolicyFrame, Workload
    from flexoff.planner.hardware import packaged_profile

    policy = policy_of(spec)
    hw = packaged_profile("h200")
    cost = CostModel(REGISTRY[model], Workload(prompt_len, gen_len), hw)
    io, _ = cost.phase_terms(PolicyFrame.of(policy), Placement.of(policy))["decode"]
    per_layer = (io["cpu_to_gpu"] * hw.cpu_to_gpu_bandwidth + io["gpu_to_cpu"] * hw.gpu_to_cpu_bandwidth
                 + io["disk_to_cpu"] * hw.disk_to_cpu_bandwidth)
    return per_layer * cost.num_layers / policy.block_size


def policy_of(spec: dict):
    from flexoff.policy import CompressionConfig, Policy

    four_bit = CompressionConfig(4, 64)
    return Policy(spec["gbs"], spec["ngb"], **placement_from_percent(spec["percent"]),
                  cpu_attention=spec["cpu_attention"],
                  compress_weight=four_bit if spec.get("compress_weight") else None,
                  compress_cache=four_bit if spec.get("compress_cache") else None)


def run_process(argv: list[str], timeout: int, log: Path) -> tuple[int, str, int]:
    """Run argv; return (exit code, output, peak RSS in bytes of that process)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.time() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.time() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.5)
    code = os.waitstatus_to_exitcode(status)
    return code, log.read_text(), usage.ru_maxrss * 1024


def run_flexoff(model: str, spec: dict, args, workdir: Path) -> dict:
    metrics_file = workdir / "metrics.json"
    w_gpu, w_cpu, c_gpu, c_cpu, a_gpu, a_cpu = spec["percent"]
    argv = [sys.executable, "-m", "flexoff", "run", "--model", model, "--dummy", "--ignore-eos", "--quiet",
            "--warmup", "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
            "--num-prompts", str(spec["gbs"] * spec["ngb"]), "--gpu-batch-size", str(spec["gbs"]),
            "--num-gpu-batches", str(spec["ngb"]), "--percent", *map(str, spec["percent"]),
            "--offload-dir", args.offload_dir, "--metrics-json", str(metrics_file)]
    if spec["cpu_attention"]:
        argv.append("--cpu-attention")
    if spec.get("gpu_mem"):
        argv += ["--gpu-mem", spec["gpu_mem"]]
    for flag in ("compress_weight", "compress_cache"):
        if spec.get(flag):
            argv.append("--" + flag.replace("_", "-"))
    code, output, rss = run_process(argv, args.timeout, workdir / "flexoff.log")
    if code != 0 or not metrics_file.exists():
        return {"error": output.strip().splitlines()[-1] if output.strip() else f"exit {code}", "rss": rss}
    metrics = json.loads(metrics_file.read_text())
    return {"prefill": metrics["prefill_throughput"], "decode": metrics["decode_throughput"],
            "total": metrics["total_throughput"], "gpu_peak": metrics["peak_memory"].get("gpu", 0), "rss": rss,
            "summary": output.strip().splitlines()[-8:]}


def run_flexgen(model: str, spec: dict, args, workdir: Path) -> dict:
    log_file = workdir / "flexgen.log.txt"
    argv = [sys.executable, str(ROOT / "bench" / "flexgen_driver.py"), "--model", f"facebook/{model}",
            "--path", "_DUMMY_", "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
            "--gpu-batch-size", str(spec["gbs"]), "--num-gpu-batches", str(spec["ngb"]),
            "--percent", *map(str, spec["percent"]), "--offload-dir", args.offload_dir, "--log-file", str(log_file)]
    if spec["cpu_attention"]:
        argv.append("--cpu-cache-compute")
    for flag in ("compress_weight", "compress_cache"):
        if spec.get(flag):
            argv.append("--" + flag.replace("_", "-"))
    if spec.get("gpu_mem"):
        # FlexGen has no cap of its own; the same allocator limit is set in its process.
        argv += ["--gpu-mem-cap", spec["gpu_mem"]]
    if args.flexgen_fewer_batch:
        argv += ["--debug-mode", "fewer_batch"]
    code, output, rss = run_process(argv, args.timeout, workdir / "flexgen.out")
    text = log_file.read_text() if log_file.exists() else ""
    found = {key: re.search(rf"{key} throughput: ([0-9.]+)", text) for key in ("prefill", "decode", "total")}
    peak = re.search(r"peak gpu mem: ([0-9.]+) GB", text)
    if code != 0 or not all(found.values()):
        reason = "killed (out of host memory?)" if code in (-9, 137) else (
            output.strip().splitlines()[-1] if output.strip() else f"exit {code}")
        return {"error": reason, "rss": rss}
    result = {key: float(match.group(1)) for key, match in found.items()}
    result.update(gpu_peak=float(peak.group(1)) * 2**30 if peak else 0, rss=rss)
    return result


def fmt(result: dict | None, key: str) -> str:
    if not result or "error" in result:
        return "—"
    return f"{result[key]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-30b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--systems", default="flexoff,flexgen")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated names from POLICIES")
    parser.add_argument("--offload-dir", default=tempfile.gettempdir())
    parser.add_argument("--timeout", type=int, default=480, help="seconds per run")
    parser.add_argument("--flexgen-fewer-batch", action="store_true",
                        help="FlexGen's own projection from a partial run (--debug-mode fewer_batch)")
    parser.add_argument("--json", help="write all results here")
    args = parser.parse_args()
    systems = args.systems.split(",")
    results = {}
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"# {args.model}, prompt {args.prompt_len}, generate {args.gen_len}, on {card}", flush=True)
    for name in args.policies.split(","):
        spec = POLICIES[name]
        row = {"policy": name, "roofline_decode": roofline(args.model, spec, args.gen_len),
               "moved_bytes_per_token": moved_bytes_per_token(args.model, spec, args.prompt_len, args.gen_len)}
        for system in systems:
            with tempfile.TemporaryDirectory() as workdir:
                runner = run_flexoff if system == "flexoff" else run_flexgen
                row[system] = runner(args.model, spec, args, Path(workdir))
            print(f"{name} · {system}: {row[system]}", flush=True)
        results[name] = row
    header = ("| policy | system | prefill | decode | total | peak GPU GiB | peak RSS GiB | decode / roofline "
              "| MB moved per token |")
    print("\n" + header + "\n|" + "---|" * 9)
    for name, row in results.items():
        for system in systems:
            res = row.get(system) or {}
            ok = "error" not in res
            print(f"| {name} | {system} | {fmt(res, 'prefill')} | {fmt(res, 'decode')} | {fmt(res, 'total')} | "
                  f"{res.get('gpu_peak', 0) / 2**30:.1f} | {res.get('rss', 0) / 2**30:.1f} | "
                  f"{(res['decode'] / row['roofline_decode'] if ok else 0):.0%} | "
                  f"{row['moved_bytes_per_token'] / 1e6:.0f} |"
                  + ("" if ok else f" {res['error'][:80]}"))
        if all(s in row and "error" not in row[s] for s in ("flexoff", "flexgen")):
            print(f"| {name} | flexoff / flexgen | " + " | ".join(
                f"{row['flexoff'][k] / row['flexgen'][k]:.2f}×" for k in ("prefill", "decode", "total")) + " | | | | |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
