"""Throughput over 1, 2 and 4 GPUs of one host: `flexoff run --pipeline-parallel G --policy auto` on
dummy weights, each GPU capped alike, the planner's prediction beside each figure.

    python bench/scaling.py --model opt-66b --gpus 1,2 --gpu-mem 16GiB --hardware h100 --cpu-mem 230GiB \
        --num-prompts 120 --gen-len 8 --offload-dir /tmp/off --json scaling.json

Every count of GPUs runs the same prompts in a process group of its own, started by flexoff
itself (one process per GPU), after a short untimed pass (--warmup). The policy is searched for
each count: the planner splits the layers and plans each stage for its share of the host's memory.
The speed-up is against the first count given (1 GPU at the same cap).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEARCHED = re.compile(r"^searched   (?:stage (\d+) \(layers \d+-\d+\): )?(.*) for prompt .*: ([0-9.]+) token/s predicted$",
                      re.M)


def run_one(args, gpus: int) -> dict:
    """One `flexoff run` over ``gpus`` GPUs: its metrics, the planned policies and the prediction."""
    with tempfile.TemporaryDirectory() as scratch:
        metrics_path = Path(scratch) / "metrics.json"
        command = [sys.executable, "-m", "flexoff", "run", "--model", args.model, "--dummy", "--policy", "auto",
                   "--compress", args.compress, "--num-prompts", str(args.num_prompts), "--prompt-len",
                   str(args.prompt_len), "--gen-len", str(args.gen_len), "--ignore-eos", "--quiet", "--warmup",
                   "--metrics-json", str(metrics_path)]
        for flag in ("hardware", "gpu_mem", "cpu_mem", "offload_dir", "dtype", "device"):
            if getattr(args, flag):
                command += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
        if gpus > 1:
            command += ["--pipeline-parallel", str(gpus)]
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - started
        row = {"gpus": gpus, "command": " ".join(command[1:]), "wall_s": round(wall, 1), "returncode": proc.returncode}
        if proc.returncode != 0:
            row["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
            return row
        metrics = json.loads(metrics_path.read_text())
    searched = SEARCHED.findall(proc.stderr)
    row.update(total=metrics["total_throughput"], decode=metrics["decode_throughput"],
               prefill=metrics["prefill_throughput"], policies=[policy for _, policy, _ in searched],
               predicted=min(float(rate) for _, _, rate in searched) if searched else None,
               summary=proc.stdout.strip().splitlines())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="opt-66b")
    parser.add_argument("--gpus", default="1,2", help="comma-separated GPU counts (default 1,2)")
    parser.add_argument("--gpu-mem", help="each GPU's cap, e.g. 16GiB")
    parser.add_argument("--cpu-mem", help="the host's memory flexoff may use, shared by the processes")
    parser.add_argument("--hardware", help="profile the planner plans on (default: the saved one)")
    parser.add_argument("--compress", default="off", choices=("off", "auto", "on"))
    parser.add_argument("--offload-dir")
    parser.add_argument("--dtype", help="as flexoff run's (default auto: fp16 on CUDA)")
    parser.add_argument("--device", help="as flexoff run's (default auto)")
    parser.add_argument("--num-prompts", type=int, default=120)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=8)
    parser.add_argument("--timeout", type=int, default=900, help="seconds for each run")
    parser.add_argument("--json", help="write every row here, after each run")
    args = parser.parse_args()
    rows = []
    for gpus in [int(g) for g in args.gpus.split(",")]:
        rows.append(run_one(args, gpus))
        row = rows[-1]
        base = rows[0].get("total")
        if "total" in row:
            speedup = f"{row['total'] / base:.2f}x" if base else "-"
            predicted = f"{row['predicted']:.1f}" if row["predicted"] else "-"
            print(f"{gpus} GPU  total {row['total']:8.2f} token/s  decode {row['decode']:8.2f}  predicted {predicted:>8}  "
                  f"speed-up {speedup}  wall {row['wall_s']} s  policies {row['policies']}", flush=True)
        else:
            print(f"{gpus} GPU  failed ({row['returncode']}): {row['error']}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
