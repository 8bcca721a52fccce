"""Runs, each in its own process, so that one running out of memory (or past its time) leaves the
others alone: a policy with dummy weights through ``flexoff.LLM(...).generate``, the machine's
profile (`flexoff profile`), and the card's name.

``python -m bench.calibration.runner SPEC.json`` is the child side of a run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLL_SECONDS = 0.2
# A run that has written its results may take this long more to exit: giving back a hundred GiB of
# pinned host memory took 40 s on the H200 machine, which is the run's end, not its measurement.
EXIT_GRACE_SECONDS = 120.0


def _run_child(argv: list[str], log_file: Path, timeout: float,
               done: Path | None = None) -> tuple[int | None, int, float]:
    """(exit code or None when killed at ``timeout``, peak resident set in bytes, seconds). Once
    ``done`` exists, the child has EXIT_GRACE_SECONDS more to exit, past ``timeout`` if need be."""
    started = time.time()
    with open(log_file, "w") as log:
        # Its own session, so that a timeout kills whatever it started as well.
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    # Stopped from outside (a time limit around the whole call, Ctrl-C), this process takes the run
    # with it: in a session of its own the run would live on, holding its pinned host memory, and
    # the next call's first run would find the host's RAM taken.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _wait(proc.pid, started, started + timeout, done)
    except BaseException:
        try:
            _kill(proc.pid)
        except (ProcessLookupError, ChildProcessError):  # it had ended on its own
            pass
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _kill(pid: int):
    os.killpg(pid, signal.SIGKILL)
    return os.wait4(pid, 0)[2]


def _wait(pid: int, started: float, deadline: float, done: Path | None) -> tuple[int | None, int, float]:
    while True:
        waited, status, usage = os.wait4(pid, os.WNOHANG)
        if waited:
            return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, time.time() - started
        if done is not None and done.exists():
            deadline, done = max(deadline, time.time() + EXIT_GRACE_SECONDS), None
        if time.time() > deadline:
            return None, _kill(pid).ru_maxrss * 1024, time.time() - started
        time.sleep(POLL_SECONDS)


def _last_line(log_file: Path) -> str:
    lines = [line for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def measure(model: str, policy, *, prompt_len: int, gen_len: int, num_prompts: int, gpu_mem: str | None,
            cpu_mem: str | None, offload_dir: str, warmup: bool, timeout: float, workdir: Path) -> dict:
    """Measured throughput and peak memory of one run, or {"error": ...} when it failed."""
    spec_file, metrics_file, log_file = (workdir / name for name in ("spec.json", "metrics.json", "child.log"))
    policy_file = workdir / "policy.json"
    policy.save(policy_file)
    metrics_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({
        "model": model, "policy": str(policy_file), "prompt_len": prompt_len, "gen_len": gen_len,
        "num_prompts": num_prompts, "gpu_mem": gpu_mem, "cpu_mem": cpu_mem, "offload_dir": offload_dir,
        "warmup": warmup, "out": str(metrics_file)}))
    code, peak_rss, seconds = _run_child([sys.executable, "-m", "bench.calibration.runner", str(spec_file)],
                                         log_file, timeout, done=metrics_file)
    if code is None and not metrics_file.exists():
        return {"error": f"timed out after {timeout:.0f} s", "seconds": seconds}
    if code not in (0, None) or not metrics_file.exists():  # None: killed on its way out, results written
        return {"error": _last_line(log_file) or f"exit {code}", "exit": code, "seconds": seconds}
    metrics = json.loads(metrics_file.read_text())
    peak = metrics.get("peak_memory", {})
    return {
        "total_throughput": metrics["total_throughput"],
        "prefill_throughput": metrics["prefill_throughput"],
        "decode_throughput": metrics["decode_throughput"],
        "gpu": peak.get("gpu"),
        # what the card held: the allocated peak plus blocks a side stream still read, and rounding
        "gpu_reserved": peak.get("gpu_reserved"),
        # Of the GPU peak, new keys and values the host stores may hold (the estimate reserves three prefills')
        "gpu_store_stream": peak.get("gpu_store_stream_peak"),
        "cpu": max(peak_rss, peak.get("cpu_rss", 0)) - metrics["baseline_rss"],
        "disk": peak.get("disk"),
        "build_seconds": metrics["build_seconds"],
        "generate_seconds": metrics["wall_seconds"],
        "seconds": seconds,
        "card": metrics.get("card"),
    }


def child(spec_file: str) -> None:
    """Build the model, generate, write the metrics as JSON."""
    import psutil
    import torch

    import flexoff
    from flexoff.policy import Policy
    from flexoff.runtime.sampling import SamplingParams

    spec = json.loads(Path(spec_file).read_text())
    card = None
    if torch.cuda.is_available():
        torch.cuda.init()
        card = torch.cuda.get_device_name()
    # Python, torch and the CUDA context are not the model's.
    baseline_rss = psutil.Process().memory_info().rss
    started = time.perf_counter()
    llm = flexoff.LLM(spec["model"], dummy=True, policy=Policy.load(spec["policy"]), offload_dir=spec["offload_dir"],
                      gpu_mem=spec["gpu_mem"], cpu_mem=spec["cpu_mem"])
    build_seconds = time.perf_counter() - started
    generator = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size
    prompts = [torch.randint(3, vocab, (spec["prompt_len"],), generator=generator).tolist()
               for _ in range(spec["num_prompts"])]
    if spec["warmup"]:
        llm.generate(prompts[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))
    started = time.perf_counter()
    result = llm.generate(prompts, SamplingParams(max_new_tokens=spec["gen_len"], ignore_eos=True))
    metrics = result.metrics.to_dict()
    metrics.update(wall_seconds=time.perf_counter() - started, build_seconds=build_seconds,
                   baseline_rss=baseline_rss, card=card)
    out = Path(spec["out"])
    partial = out.with_suffix(".partial")
    partial.write_text(json.dumps(metrics, indent=2))
    os.replace(partial, out)  # whole: the parent takes its existence as the run's end
    llm.close()


def device_info() -> dict:
    """{"cuda": bool, "card": name or None}, asked of a child so that this process holds no CUDA
    context (it would take GPU memory from the runs)."""
    code = ("import json, torch; ok = torch.cuda.is_available(); "
            "print(json.dumps({'cuda': ok, 'card': torch.cuda.get_device_name() if ok else None}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_profile(output: Path, disk_dir: str, quick: bool, timeout: float) -> None:
    """This machine's profile, as `flexoff profile` measures it, saved to ``output``."""
    argv = [sys.executable, "-m", "flexoff", "profile", "--output", str(output), "--disk-dir", disk_dir]
    if quick:
        argv.append("--quick")
    log_file = output.with_suffix(".log")
    code, _, seconds = _run_child(argv, log_file, timeout)
    if code != 0:
        why = "timed out" if code is None else _last_line(log_file)
        raise SystemExit(f"measuring the profile failed ({why}); see {log_file}")
    print(f"profile measured in {seconds:.0f} s, saved to {output}", flush=True)


if __name__ == "__main__":
    child(sys.argv[1])
