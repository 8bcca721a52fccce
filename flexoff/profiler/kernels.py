"""The profiler's timing of compute kernels: the sizes a profile measures at, its time budget, a
best-of timer, and the rates of the kernels the runtime runs (matmuls, attention on the device and on
the CPU, 4-bit dequantization and quantization of the cache), each through the runtime's own functions."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProfileSizes:
    """The shapes and sizes a profile measures at (quick or full)."""

    copy_bytes: tuple[int, ...]
    disk_bytes: int
    matmul_rows: tuple[int, ...]
    matmul_inner: int
    matmul_outer: int
    attention_batch: int
    dequant_elements: int
    min_seconds: float  # repeat each timing until this much time has passed
    cold_bytes: int  # CPU attention cycles through this much cache, more than CPU caches hold
    budget_seconds: float | None = None  # the whole profile's time budget; None: no deadline


class Deadline:
    """When a measurement must stop repeating (``at`` on ``clock``; None: never). A measurement checks
    it between timed calls, so it overruns by at most the call it is in."""

    def __init__(self, at: float | None = None, clock: Callable[[], float] = time.perf_counter):
        self.at, self.clock = at, clock

    def passed(self) -> bool:
        return self.at is not None and self.clock() >= self.at


class Budget:
    """A profile's time budget, spent measurement by measurement. Each measurement, as it starts, gets
    a deadline: its weight's share of the time left among the measurements still to come, so that
    time one leaves unused, or overruns, passes to the rest. ``progress(fraction, step)`` hears each
    start (the weight done before it, as a fraction of all) and the end (1.0, None)."""

    def __init__(self, seconds: float | None, weights: Mapping[str, float],
                 progress: Callable[[float, str | None], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.weights, self.clock = dict(weights), clock
        self.progress = progress or (lambda fraction, step: None)
        self.total = self.left = float(sum(self.weights.values()))
        self.end = None if seconds is None else clock() + seconds

    def start(self, step: str) -> Deadline:
        """Measurement ``step`` begins: its progress is reported and its deadline returned."""
        self.progress(1.0 - self.left / self.total, step)
        weight = self.weights[step]
        at = None
        if self.end is not None:
            now = self.clock()
            at = now + max(0.0, self.end - now) * weight / self.left
        self.left -= weight
        return Deadline(at, self.clock)

    def finish(self) -> None:
        self.progress(1.0, None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn, device: torch.device, min_seconds: float, max_repeats: int = 50,
                 deadline: Deadline | None = None) -> float:
    """Best seconds per call of ``fn`` after one warm-up call: at least two timed calls, repeated until
    ``min_seconds`` have passed; past ``deadline``, no more than one."""
    deadline = deadline or Deadline()
    clock = deadline.clock
    fn()
    sync(device)
    best, spent, repeats = float("inf"), 0.0, 0
    while (spent < min_seconds or repeats < 2) and repeats < max_repeats and not (repeats and deadline.passed()):
        start = clock()
        fn()
        sync(device)
        elapsed = clock() - start
        best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
    return best


def matmul_curve(device, dtype, sizes: ProfileSizes, deadline: Deadline | None = None):
    weight = torch.randn(sizes.matmul_inner, sizes.matmul_outer, device=device, dtype=dtype)
    points, raw = [], []
    for rows in sizes.matmul_rows:
        x = torch.randn(rows, sizes.matmul_inner, device=device, dtype=dtype)
        seconds = best_seconds(lambda x=x: x @ weight, device, sizes.min_seconds, deadline=deadline)
        flops = 2.0 * rows * sizes.matmul_inner * sizes.matmul_outer / seconds
        raw.append({"rows": rows, "seconds": seconds, "flop_per_s": flops})
        points.append([rows, flops])
    # Noise can make a larger m look slower; the cost model wants the envelope.
    for i in range(1, len(points)):
        points[i][1] = max(points[i][1], points[i - 1][1])
    return points, raw


def attention_rates(device, dtype, sizes: ProfileSizes, heads=32, head_dim=128, prompt=512, keys=544,
                    deadline: Deadline | None = None):
    from ..models.common import attention, attention_mask

    batch = sizes.attention_batch * heads
    # Prefill as the runtime runs it: its attention function, with a causal and padding mask.
    q = torch.randn(sizes.attention_batch, heads, prompt, head_dim, device=device, dtype=dtype)
    valid = torch.ones(sizes.attention_batch, prompt, dtype=torch.bool, device=device)
    valid[::2, :prompt // 8] = False  # left padding on half the rows
    mask = attention_mask(valid, 0, prompt)
    prefill_seconds = best_seconds(lambda: attention(q, q, q, mask), device, sizes.min_seconds, deadline=deadline)
    q1 = torch.randn(batch, 1, head_dim, device=device, dtype=dtype)
    cache = torch.randn(batch, keys, head_dim, device=device, dtype=dtype)

    def decode():
        scores = torch.softmax(q1 @ cache.transpose(1, 2), dim=-1)
        return scores @ cache

    decode_seconds = best_seconds(decode, device, sizes.min_seconds, deadline=deadline)
    big = torch.empty(sizes.dequant_elements, device=device, dtype=torch.float16)
    copy = torch.empty_like(big)
    copy_seconds = best_seconds(lambda: copy.copy_(big), device, sizes.min_seconds, deadline=deadline)
    return {
        "prefill_attention_flop_per_s": 4.0 * batch * prompt * prompt * head_dim / prefill_seconds,
        "decode_attention_flop_per_s": 4.0 * batch * keys * head_dim / decode_seconds,
        "gpu_memory_bytes_per_s": 2.0 * big.numel() * 2 / copy_seconds,
        "raw": {"heads_x_batch": batch, "head_dim": head_dim, "prompt": prompt, "keys": keys,
                "prefill_seconds": prefill_seconds, "decode_seconds": decode_seconds,
                "copy_bytes": big.numel() * 2, "copy_seconds": copy_seconds},
    }


def cpu_attention_seconds(rows: int, sizes: ProfileSizes, heads=56, head_dim=128, keys=544,
                          deadline: Deadline | None = None) -> float:
    """Seconds of one decode attention over ``rows`` sequences as the runtime runs it on the CPU: its
    own function, over an fp16 cache in the row-major layout it keeps for CPU attention, with a
    padding mask. Calls cycle through enough distinct caches (``sizes.cold_bytes`` in all) that none is
    still in a CPU cache when it is read again, as a layer's cache is not in the runtime."""
    from ..runtime.kv import cpu_attention

    shape = (rows, heads, keys, head_dim)
    copies = max(1, -(-sizes.cold_bytes // (2 * 2 * math.prod(shape))))
    q = torch.randn(rows, heads, 1, head_dim, dtype=torch.float16)
    # One sequence's random cache, copied to every row: drawing all of a large call's (half a GB)
    # took seconds, and the kernel's time does not depend on the values.
    row = torch.randn(1, *shape[1:], dtype=torch.float16)
    caches = [(row.expand(shape).contiguous(), row.expand(shape).contiguous()) for _ in range(copies)]
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
    mask[:, :, :, :8] = False  # left padding

    def attend():
        for keys_cache, values_cache in caches:
            cpu_attention(q, keys_cache.__getitem__, values_cache.__getitem__, mask)

    return best_seconds(attend, torch.device("cpu"), sizes.min_seconds, deadline=deadline) / copies


def cpu_attention_rate(sizes: ProfileSizes, heads=56, head_dim=128, keys=544, deadline: Deadline | None = None):
    """CPU attention's FLOP/s and its fixed cost per call, fit to a full call (the full profile's
    cache of 32 sequences of an OPT-30B layer, 0.5 GB, is larger than CPU caches, as real ones are)
    and a call of a few sequences: seconds = per_call + FLOPs / rate."""
    from ..layout import CPU_ATTENTION_ROWS

    flops_per_row = 4.0 * heads * keys * head_dim
    small = 2
    large = min(max(2 * sizes.attention_batch, 2 * small), CPU_ATTENTION_ROWS)
    large_seconds = cpu_attention_seconds(large, sizes, heads, head_dim, keys, deadline)
    small_seconds = cpu_attention_seconds(small, sizes, heads, head_dim, keys, deadline)
    slope = (large_seconds - small_seconds) / (large - small)
    raw = {"heads": heads, "keys": keys, "head_dim": head_dim, "rows": [small, large],
           "seconds": [small_seconds, large_seconds], "threads": torch.get_num_threads()}
    per_call = small_seconds - small * slope
    if slope <= 0 or per_call <= 0:  # timing noise: no fixed cost can be told apart from the FLOPs
        return large * flops_per_row / large_seconds, 0.0, raw
    return flops_per_row / slope, per_call, raw


def dequant_rate(device, sizes: ProfileSizes, group_size: int = 64, shape: tuple[int, ...] = (4096,),
                 deadline: Deadline | None = None):
    """4-bit dequantization through flexoff's own codec, as the runtime runs it, of a tensor whose
    trailing dimensions are ``shape``, grouped along the last: a weight's rows, or a slot-major KV
    cache's (sequences, heads, head_dim) slots."""
    from ..compression import dequantize, quantize

    lead = max(1, sizes.dequant_elements // math.prod(shape))
    full = (lead, *shape)
    packed = quantize(torch.randn(full, device=device, dtype=torch.float16), bits=4, group_size=group_size)
    out = torch.empty(full, device=device, dtype=torch.float16)
    seconds = best_seconds(lambda: dequantize(packed, out=out), device, sizes.min_seconds, deadline=deadline)
    return out.numel() / seconds, {"shape": list(full), "group_size": group_size, "seconds": seconds}


def kv_quant_rate(device, dtype, sizes: ProfileSizes, heads=32, prompt=512, head_dim=128,
                  deadline: Deadline | None = None):
    """Quantizing a prefill's keys (batch, heads, prompt, head_dim) into a slot-major compressed
    cache, through the codec as the runtime calls it."""
    from ..compression import CompressedTensor, quantize
    from ..runtime.kv_storage import SLOT_MAJOR

    keys = torch.randn(sizes.attention_batch, heads, prompt, head_dim, device=device, dtype=dtype)
    out = CompressedTensor.empty(SLOT_MAJOR.shape(prompt, sizes.attention_batch, heads, head_dim), dtype,
                                 4, 64, -1, device)
    seconds = best_seconds(lambda: quantize(SLOT_MAJOR.arrange(keys), 4, 64, -1, out=out), device, sizes.min_seconds,
                           deadline=deadline)
    return keys.numel() / seconds, {"shape": list(keys.shape), "group_size": 64, "seconds": seconds}
