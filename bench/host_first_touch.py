"""Is a machine's first touch of its host memory slower than later ones?

A fresh machine's first run has measured 14-21% slower than later runs. One candidate lies below
flexoff: a virtual machine whose memory the hypervisor backs only when the guest first touches
it. Each of --processes processes, one after another, touches --gib GiB of host memory for each
of --threads the way the runtime's pinned tiers do (2 MiB aligned, huge pages advised, zeroed),
holding every buffer until it exits, and prints the rates. If only the first process is slow, the
slowness is the machine's and a later process on it no longer pays it; the thread counts say
whether more cores fault memory in faster.

    python bench/host_first_touch.py [--gib 8] [--threads 1,16] [--processes 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def touch(gib: float, threads: list[int]) -> list[dict]:
    """For each thread count, seconds to allocate and zero ``gib`` GiB as the pinned tiers allocate
    host memory (``touched_pages``), and to fill it again (memory already backed); every buffer held
    to the end."""
    import torch

    sys.path.insert(0, str(ROOT))
    from flexoff.runtime.tiers import touched_pages

    nbytes, held, out = int(gib * (1 << 30)), [], []
    for count in threads:
        torch.set_num_threads(count)
        started = time.perf_counter()
        buffer = touched_pages(nbytes)
        first = time.perf_counter() - started
        started = time.perf_counter()
        buffer.fill_(1)
        again = time.perf_counter() - started
        held.append(buffer)
        out.append({"threads": count, "gib": gib, "first_s": first, "again_s": again, "nbytes": nbytes})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="GiB a buffer (default 8)")
    parser.add_argument("--threads", default="1,16", help="a buffer for each of these thread counts (default 1,16)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if args.child:
        print(json.dumps(touch(args.gib, threads)))
        return 0
    print("| process | threads | GiB | first touch s | GB/s | filled again s | GB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in range(1, args.processes + 1):
        out = subprocess.run([sys.executable, __file__, "--child", "--gib", str(args.gib), "--threads", args.threads],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(f"| {n} | failed: {(out.stderr.strip().splitlines() or ['exit %d' % out.returncode])[-1]} |")
            return 1
        for r in json.loads(out.stdout.strip().splitlines()[-1]):
            print(f"| {n} | {r['threads']} | {r['gib']:g} | {r['first_s']:.2f} | {r['nbytes'] / r['first_s'] / 1e9:.1f} | "
                  f"{r['again_s']:.2f} | {r['nbytes'] / r['again_s'] / 1e9:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
