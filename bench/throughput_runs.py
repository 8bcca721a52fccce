"""One run of each system for bench/throughput.py, each in its own process: flexoff at a named or a searched
policy, the published FlexGen 0.1.8 (bench/flexgen_driver.py), and HF Accelerate (bench/hf_accelerate_driver.py).

A run returns a dict of prefill / decode / total token/s, peak GPU bytes and the process's peak RSS, or
{"error": "cannot run: <why>", "rss": ...} when it failed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HF_MARK = "HF_RESULT "


def run_process(argv: list[str], timeout: int, log: Path) -> tuple[int, str, int, bool]:
    """Run argv; return (exit code, output, peak RSS in bytes of that process, whether it timed out)."""
    timed_out = False
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
                timed_out = True
                break
            time.sleep(0.5)
    code = os.waitstatus_to_exitcode(status)
    return code, log.read_text(), usage.ru_maxrss * 1024, timed_out


def failure(code: int, output: str, timed_out: bool, timeout: int) -> str:
    """'cannot run: <why>' in a few words, from how the process ended and what it printed last."""
    text = output.lower()
    if timed_out:
        why = f"timed out after {timeout} s"
    elif "out of memory" in text and ("cuda" in text or "gpu" in text):
        why = "out of GPU memory"
    elif code in (-9, 137) or "cannot allocate memory" in text or "defaultcpuallocator" in text:
        why = "out of host memory (killed)" if code in (-9, 137) else "out of host memory"
    else:
        lines = output.strip().splitlines()
        why = lines[-1].removeprefix("flexoff: error: ")[:160] if lines else f"exit code {code}"
    return f"cannot run: {why}"


def cap_flags(args, spec: dict | None = None) -> list[str]:
    """flexoff's memory caps: the bench's, else the named policy's own GPU cap."""
    gpu = args.gpu_mem or (spec or {}).get("gpu_mem")
    return (["--gpu-mem", gpu] if gpu else []) + (["--cpu-mem", args.cpu_mem] if args.cpu_mem else [])


def _flexoff(args, workdir: Path, policy_argv: list[str], num_prompts: int) -> dict:
    metrics_file = workdir / "metrics.json"
    argv = [sys.executable, "-m", "flexoff", "run", "--model", args.model, "--dummy", "--ignore-eos", "--quiet",
            "--warmup", "--dtype", args.dtype, "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
            "--num-prompts", str(num_prompts), "--offload-dir", args.offload_dir,
            "--metrics-json", str(metrics_file), *policy_argv]
    code, output, rss, timed_out = run_process(argv, args.timeout, workdir / "flexoff.log")
    if code != 0 or not metrics_file.exists():
        return {"error": failure(code, output, timed_out, args.timeout), "rss": rss}
    metrics = json.loads(metrics_file.read_text())
    peak = metrics["peak_memory"]
    return {"prefill": metrics["prefill_throughput"], "decode": metrics["decode_throughput"],
            "total": metrics["total_throughput"], "gpu_peak": peak.get("gpu", 0), "rss": rss,
            "policy": metrics["policy"], "summary": output.strip().splitlines()[-8:]}


def run_flexoff(spec: dict, args, workdir: Path) -> dict:
    """flexoff at a named policy (FlexGen's flags)."""
    argv = ["--gpu-batch-size", str(spec["gbs"]), "--num-gpu-batches", str(spec["ngb"]),
            "--percent", *map(str, spec["percent"]), *cap_flags(args, spec)]
    if spec["cpu_attention"]:
        argv.append("--cpu-attention")
    for flag in ("compress_weight", "compress_cache"):
        if spec.get(flag):
            argv.append("--" + flag.replace("_", "-"))
    return _flexoff(args, workdir, argv, spec["gbs"] * spec["ngb"])


def run_flexoff_auto(args, workdir: Path, num_prompts: int) -> dict:
    """flexoff's own search (--policy auto) on the bench's hardware profile, compression and caps."""
    argv = ["--policy", "auto", "--hardware", args.hardware, "--compress", args.compress, *cap_flags(args)]
    return _flexoff(args, workdir, argv, num_prompts)


def flexgen_refusal(model: str) -> str | None:
    """Why FlexGen cannot run ``model`` (it builds OPT models only), or None when it can."""
    from flexoff.models import REGISTRY

    return None if REGISTRY[model].family == "opt" else f"cannot run: it runs OPT models only, not {model}"


def run_flexgen(spec: dict, args, workdir: Path) -> dict:
    refusal = flexgen_refusal(args.model)
    if refusal:
        return {"error": refusal, "rss": 0}
    log_file = workdir / "flexgen.log.txt"
    argv = [sys.executable, str(ROOT / "bench" / "flexgen_driver.py"), "--model", f"facebook/{args.model}",
            "--path", "_DUMMY_", "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
            "--gpu-batch-size", str(spec["gbs"]), "--num-gpu-batches", str(spec["ngb"]),
            "--percent", *map(str, spec["percent"]), "--offload-dir", args.offload_dir, "--log-file", str(log_file)]
    if spec["cpu_attention"]:
        argv.append("--cpu-cache-compute")
    for flag in ("compress_weight", "compress_cache"):
        if spec.get(flag):
            argv.append("--" + flag.replace("_", "-"))
    gpu = args.gpu_mem or spec.get("gpu_mem")
    if gpu:
        # FlexGen has no cap of its own; the same allocator limit is set in its process.
        argv += ["--gpu-mem-cap", gpu]
    if args.flexgen_fewer_batch:
        argv += ["--debug-mode", "fewer_batch"]
    code, output, rss, timed_out = run_process(argv, args.timeout, workdir / "flexgen.out")
    text = log_file.read_text() if log_file.exists() else ""
    found = {key: re.search(rf"{key} throughput: ([0-9.]+)", text) for key in ("prefill", "decode", "total")}
    peak = re.search(r"peak gpu mem: ([0-9.]+) GB", text)
    if code != 0 or not all(found.values()):
        return {"error": failure(code, output, timed_out, args.timeout), "rss": rss}
    result = {key: float(match.group(1)) for key, match in found.items()}
    result.update(gpu_peak=float(peak.group(1)) * 2**30 if peak else 0, rss=rss)
    return result


def hf_result(output: str) -> dict | None:
    """The driver's last HF_RESULT line, parsed; None if it printed none."""
    lines = [line for line in output.splitlines() if line.startswith(HF_MARK)]
    return json.loads(lines[-1][len(HF_MARK):]) if lines else None


def run_hf(args, workdir: Path) -> dict:
    argv = [sys.executable, str(ROOT / "bench" / "hf_accelerate_driver.py"), "--model", args.model,
            "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)]
    if args.gpu_mem:
        argv += ["--gpu-mem", args.gpu_mem]
    if args.hf_batch_sizes:
        argv += ["--batch-sizes", args.hf_batch_sizes]
    if args.hf_experts:
        argv += ["--experts", args.hf_experts]
    code, output, rss, timed_out = run_process(argv, args.timeout, workdir / "hf.out")
    result = hf_result(output)
    if result is None or (code != 0 and "error" not in result):
        return {"error": failure(code, output, timed_out, args.timeout), "rss": rss}
    result["rss"] = rss
    return result
