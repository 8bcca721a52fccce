"""Do CPU attention and host-to-GPU weight copies slow each other down?

Both read host memory: CPU attention reads the cache, the copy engine reads pinned weights. This
measures each alone and both at once (the slowdown the cost model charges), and the
page-cache read rate of a file that was just written (what a disk tier smaller than free RAM sees),
with the same copy loop and disk reads as `flexoff profile`.

    python bench/host_contention.py [--seqs 32 --heads 56 --keys 544] [--copy-gib 1] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexoff.profiler.machine import cached_read_bandwidth, copies_streaming  # noqa: E402
from flexoff.runtime.kv import cpu_attention  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--keys", type=int, default=544)
    parser.add_argument("--copy-gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    n, h, s, d = args.seqs, args.heads, args.keys, 128
    q = torch.randn(n, h, 1, d, dtype=torch.float16)
    keys = torch.randn(n, h, s, d, dtype=torch.float16)
    values = torch.randn(n, h, s, d, dtype=torch.float16)
    mask = torch.ones(n, 1, 1, s, dtype=torch.bool)
    cache_bytes = 2 * keys.numel() * keys.element_size()

    def attend():
        cpu_attention(q, keys.__getitem__, values.__getitem__, mask)

    attention_alone = timed(attend, args.repeats)
    print(f"CPU attention alone: {attention_alone * 1e3:.2f} ms, {cache_bytes / attention_alone / 1e9:.1f} GB/s "
          f"of cache ({torch.get_num_threads()} threads)")

    if torch.cuda.is_available():
        nbytes = int(args.copy_gib * (1 << 30))
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def copy():
            device.copy_(host, non_blocking=True)
            torch.cuda.synchronize()

        copy_alone = timed(copy, args.repeats)
        print(f"pinned H2D copy alone: {copy_alone * 1e3:.2f} ms, {nbytes / copy_alone / 1e9:.1f} GB/s")
        del host, device
        # Both at once: the profiler's copy loop runs on a thread while attention runs on this one.
        with copies_streaming(torch.device("cuda"), nbytes) as copies:
            time.sleep(0.05)
            start, first = time.perf_counter(), copies[0]
            together = timed(attend, args.repeats)
            elapsed, done = time.perf_counter() - start, copies[0] - first
        print(f"together: CPU attention {together * 1e3:.2f} ms ({attention_alone / together:.0%} of alone), "
              f"copies {done * nbytes / elapsed / 1e9:.1f} GB/s ({done * nbytes / elapsed / (nbytes / copy_alone):.0%} "
              f"of alone)")

    # A file just written is read back from the page cache while free memory holds it.
    rate, _ = cached_read_bandwidth(args.dir, 2 << 30)
    print(f"disk tier reads of a 2 GiB file just written (page cache): {rate / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
