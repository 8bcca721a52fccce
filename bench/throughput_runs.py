"""One run of each system for bench/throughput.py, each in its own process: flexoff at a named or a searched
policy, the published FlexGen 0.1.8 (bench/flexgen_driver.py), HF Accelerate (bench/hf_accelerate_driver.py),
DeepSpeed ZeRO-Inference (bench/deepspeed_driver.py) and llama.cpp (bench/llamacpp.py).

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


def run_process(argv: list[str], timeout: int, log: Path, sample=None) -> tuple[int, str, int, bool]:
    """Run argv; return (exit code, output, peak RSS in bytes of that process, whether it timed out).
    ``sample(pid)``, if given, is called while it runs, twice a second."""
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
            if sample:
                sample(proc.pid)
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
        lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
        # A warning printed at exit (torch.distributed's, say) follows the error: skip past it.
        meant = [line for line in lines if "warning" not in line.lower()] or lines
        errors = [line for line in meant if _ERROR_LINE.search(line)]
        why = (errors or meant)[-1].removeprefix("flexoff: error: ")[:160] if meant else f"exit code {code}"
    return f"cannot run: {why}"


_ERROR_LINE = re.compile(r"error\b|exception\b|\bfailed\b", re.IGNORECASE)


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
    if getattr(args, "no_cuda_graphs", False):
        argv.append("--no-cuda-graphs")
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
    extra = (["--batch-sizes", args.hf_batch_sizes] if args.hf_batch_sizes else []) \
        + (["--experts", args.hf_experts] if args.hf_experts else [])
    return _driver("hf_accelerate_driver.py", extra, args, workdir / "hf.out")


def run_deepspeed(args, workdir: Path) -> dict:
    """DeepSpeed ZeRO-Inference (bench/deepspeed_driver.py) at the largest batch that fits the cap."""
    extra = ["--quant-bits", str(args.deepspeed_quant_bits)] \
        + (["--batch-sizes", args.deepspeed_batch_sizes] if args.deepspeed_batch_sizes else [])
    result = _driver("deepspeed_driver.py", extra, args, workdir / "deepspeed.out")
    if "deepspeed" in result:
        result["version"] = result["deepspeed"]  # the table names the system with it
    return result


def _driver(script: str, extra: list[str], args, log: Path) -> dict:
    """A baseline driver that ends its output with an HF_RESULT line."""
    argv = [sys.executable, str(ROOT / "bench" / script), "--model", args.model,
            "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), *extra]
    if args.gpu_mem:
        argv += ["--gpu-mem", args.gpu_mem]
    code, output, rss, timed_out = run_process(argv, args.timeout, log)
    result = hf_result(output)
    if result is None or (code != 0 and "error" not in result):
        return {"error": failure(code, output, timed_out, args.timeout), "rss": rss}
    result["rss"] = rss
    return result


def gpu_capacity(args) -> int:
    """The bytes a baseline without an allocator cap may fill: --gpu-mem, else the whole card."""
    from flexoff.units import parse_size

    if args.gpu_mem:
        return parse_size(args.gpu_mem)
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 2**62


def dummy_gguf_file(args) -> Path:
    """The model's dummy Q4_0 GGUF, written once into --offload-dir and kept for later runs."""
    from dummy_gguf import write_dummy_gguf
    from flexoff.models import REGISTRY

    path = Path(args.offload_dir) / f"{args.model}.dummy-q4_0.gguf"
    if not path.exists():
        write_dummy_gguf(REGISTRY[args.model], path)
    return path


def run_llamacpp(args, workdir: Path) -> dict:
    """llama.cpp's batched bench at each of --llamacpp-batch-sizes, its placement planned for the cap and run
    again with a larger reserve where the process's GPU memory went over it; the best total of those that ran."""
    import llamacpp
    from dummy_gguf import NotConvertible, architecture
    from flexoff.models import REGISTRY

    cfg = REGISTRY[args.model]
    try:
        architecture(cfg)
    except NotConvertible as err:
        return {"error": f"cannot run: {err}", "rss": 0}
    binary, cap = llamacpp.find_binary(args.llamacpp_bin), gpu_capacity(args)
    gguf, tried, last = dummy_gguf_file(args), [], {"error": "cannot run: no batch size was tried", "rss": 0}
    for batch in args.llamacpp_batch_sizes:
        reserve, lost = llamacpp.compute_reserve(cfg, args.llamacpp_ubatch), False
        for _ in range(4):
            offload = llamacpp.plan_offload(cfg, cap, batch, args.prompt_len, args.gen_len, reserve)
            if offload is None:
                last = {"error": f"cannot run: batch {batch}'s cache does not fit the GPU cap", "rss": 0}
                break
            argv = llamacpp.command(binary, gguf, offload, batch, args.prompt_len, args.gen_len,
                                    ubatch=args.llamacpp_ubatch)
            sampler = llamacpp.GPUSampler()
            code, output, rss, timed_out = run_process(argv, args.timeout, workdir / f"llamacpp-{batch}.out",
                                                       sampler)
            result = llamacpp.parse_result(output, args.prompt_len, args.gen_len, batch) if code == 0 else None
            if result is None and code == 0 and not lost:  # its logger lost the line: once more
                lost = True
                continue
            if result is None:
                why = "cannot run: it exited twice without its result line" if code == 0 else \
                    failure(code, output, timed_out, args.timeout)
                last = {"error": why, "rss": rss}
                break
            used = sampler.peak
            if used - llamacpp.CONTEXT_ALLOWANCE > cap:
                reserve += used - llamacpp.CONTEXT_ALLOWANCE - offload.gpu_bytes + 256 * 2**20
                last = {"error": f"cannot run: batch {batch} allocated {used / 2**30:.1f} GiB, over the cap",
                        "rss": rss}
                continue
            result.update(gpu_peak=used, rss=rss, flags=" ".join(offload.flags()))
            tried.append(result)
            break
    if not tried:
        return last
    top = max(tried, key=lambda r: r["total"])
    top.update(version=llamacpp.version(binary), tried={r["batch"]: round(r["total"], 1) for r in tried})
    return top
