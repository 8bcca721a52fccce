"""Timing shared by the micro-benchmarks: the median of several calls, by CUDA events on the GPU."""

from __future__ import annotations

import time

import torch


def median_seconds(fn, repeats: int, cuda: bool = False, warmup: int = 1) -> float:
    """Median seconds of one call of ``fn`` after ``warmup`` calls; on the GPU timed by events."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
    return sorted(samples)[len(samples) // 2]
