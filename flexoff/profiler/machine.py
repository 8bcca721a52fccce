"""``flexoff profile``: measure this machine and fit the constants the cost model needs.

On a CUDA machine the compute device is the GPU; without CUDA it is the CPU, and the "gpu" tier is
a memory budget in RAM, as everywhere in flexoff. Each measurement is kept raw in the profile's
``measurements`` and the fitted constant beside it, with a note saying which is which.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import psutil
import torch

from ..errors import ConfigError
from .host_overhead import DISK_BATCHES, GPU_BATCHES, host_overhead
from .kernels import (Budget, Deadline, ProfileSizes, attention_rates, best_seconds, cpu_attention_rate,
                              cpu_attention_seconds, dequant_rate, kv_quant_rate, matmul_curve)
from .sparse_kernel import measure_sparse_rates
from ..planner.hardware import HardwareProfile, default_profile_path

MiB = 1 << 20
GiB = 1 << 30
DISK_BLOCK = 4 * MiB
STAGE_BYTES = 256 * MiB  # about one decoder layer's disk share
# On a machine without CUDA, this share of RAM plays the GPU's memory.
CPU_ONLY_GPU_BUDGET = 0.25


# A quick profile, measured the first time a job plans without a saved one, keeps to a budget: each
# measurement repeats until its share of it has passed (a timing past it runs once), and the host
# probe runs shorter and shallower. The budget leaves room under the 30 s a first plan may take on
# a 2-core machine for what runs however late it is: each timing's first call and one more.
QUICK = ProfileSizes((16 * MiB, 64 * MiB, 256 * MiB), 256 * MiB, (1, 8, 32, 128, 512, 2048),
                     2048, 4096, 4, 16 * MiB, 0.1, 64 * MiB, budget_seconds=20.0)
QUICK_HOST_PROBE = {"steps": 6, "depths": (2, 6)}
FULL = ProfileSizes((64 * MiB, 256 * MiB, 1 * GiB), 4 * GiB, (1, 8, 32, 128, 512, 4096),
                    7168, 28672, 16, 256 * MiB, 0.5, 512 * MiB)
# A quick profile of a GPU still times its kernels at full shapes (a second or two there): at small
# shapes they are launch-bound, and priced a full card's decode at under a third of what it ran at.
QUICK_GPU = replace(QUICK, matmul_rows=FULL.matmul_rows, matmul_inner=FULL.matmul_inner, matmul_outer=FULL.matmul_outer,
                    attention_batch=FULL.attention_batch, dequant_elements=FULL.dequant_elements, budget_seconds=10.0)


def fit_bandwidth(sizes, seconds) -> tuple[float, float]:
    """Least-squares fit of seconds = latency + bytes / bandwidth; returns (bandwidth, latency)."""
    sizes, seconds = np.asarray(sizes, float), np.asarray(seconds, float)
    if len(sizes) < 2:
        return float(sizes[0] / seconds[0]), 0.0
    slope, intercept = np.polyfit(sizes, seconds, 1)
    if slope <= 0:  # noise swamped the trend: fall back to the largest transfer's rate
        return float(sizes[-1] / seconds[-1]), 0.0
    return float(1.0 / slope), float(max(intercept, 0.0))


def _copy_bandwidth(src_device, dst_device, sizes: ProfileSizes, pinned: bool, deadline: Deadline | None = None):
    seconds = []
    for nbytes in sizes.copy_bytes:
        src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
        if pinned and src_device.type == "cpu":
            src = src.pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
        if pinned and dst_device.type == "cpu":
            dst = dst.pin_memory()
        src.fill_(0x5A)  # touched, so no page is first faulted in while timed; values do not change a copy
        sync_device = dst_device if dst_device.type == "cuda" else src_device
        seconds.append(best_seconds(lambda dst=dst, src=src: dst.copy_(src, non_blocking=True), sync_device,
                                    sizes.min_seconds, deadline=deadline))
        del src, dst  # free this size's buffers before allocating the next
    bandwidth, latency = fit_bandwidth(sizes.copy_bytes, seconds)
    raw = {"bytes": list(sizes.copy_bytes), "seconds": seconds, "fit_latency_s": latency}
    return bandwidth, raw


def all_gpus_bandwidth(gpu_count: int, nbytes: int, repeats: int = 3) -> float:
    """Host-to-GPU bytes per second in all, a pinned copy of ``nbytes`` to each GPU at once on its
    own stream (the best of ``repeats``, after a warm-up): whether the GPUs' links share the way to
    host memory."""
    hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(gpu_count)]
    targets = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(gpu_count)]
    streams = [torch.cuda.Stream(device=f"cuda:{i}") for i in range(gpu_count)]
    times = []
    for _ in range(repeats + 1):
        for i in range(gpu_count):
            torch.cuda.synchronize(i)
        start = time.perf_counter()
        for host, target, stream in zip(hosts, targets, streams):
            with torch.cuda.stream(stream):
                target.copy_(host, non_blocking=True)
        for i in range(gpu_count):
            torch.cuda.synchronize(i)
        times.append(time.perf_counter() - start)
    return gpu_count * nbytes / min(times[1:])


def _disk_bandwidth(directory: str, nbytes: int):
    """Write then read a file in large blocks, bypassing the page cache with O_DIRECT; where the
    file system refuses O_DIRECT, write through, fsync, and evict the file's pages before reading."""
    nbytes = max(DISK_BLOCK, nbytes // DISK_BLOCK * DISK_BLOCK)
    buffer = mmap.mmap(-1, DISK_BLOCK)  # page-aligned, as O_DIRECT requires
    buffer.write(os.urandom(DISK_BLOCK))
    fd_tmp, path = tempfile.mkstemp(dir=directory, prefix=".flexoff-disk-profile-")
    os.close(fd_tmp)
    direct = getattr(os, "O_DIRECT", 0)
    method = "O_DIRECT"
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | direct)
            os.write(fd, buffer)
            os.lseek(fd, 0, os.SEEK_SET)
        except OSError:
            if direct == 0:
                raise
            direct, method = 0, "buffered, fsync, then posix_fadvise(DONTNEED) before reading"
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        start = time.perf_counter()
        for _ in range(nbytes // DISK_BLOCK):
            os.write(fd, buffer)
        os.fsync(fd)
        write_seconds = time.perf_counter() - start
        os.close(fd)
        if not direct and hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | direct)
        start = time.perf_counter()
        while os.readv(fd, [buffer]) > 0:
            pass
        read_seconds = time.perf_counter() - start
        os.close(fd)
    finally:
        os.unlink(path)
        buffer.close()
    raw = {"bytes": nbytes, "block_bytes": DISK_BLOCK, "method": method,
           "write_seconds": write_seconds, "read_seconds": read_seconds}
    return nbytes / read_seconds, nbytes / write_seconds, raw


def cached_read_bandwidth(directory: str, nbytes: int, streams: int = 2, deadline: Deadline | None = None):
    """Read back, through the disk tier's own reads, a file just written: what a disk tier that
    fits in the free host memory sees, since the page cache keeps its pages. Stages are read into
    pinned staging a stage at a time on the disk tier's threads, ``streams`` at once: the weight
    store's ring of two buffers lets the next stage's read start while this one's finishes."""
    from ..runtime.tiers import DiskTier

    disk = DiskTier(directory)
    try:
        region = disk.allocate("cached-read", nbytes)
        region.write(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
        stage = min(nbytes // streams, STAGE_BYTES)
        pinned = torch.cuda.is_available()
        staging = [torch.empty(stage, dtype=torch.uint8, pin_memory=pinned) for _ in range(streams)]
        offsets = range(0, nbytes - stage + 1, stage)

        def read_all():
            in_flight = []
            for i, offset in enumerate(offsets):
                if len(in_flight) == streams:  # its staging buffer is the one to refill
                    in_flight.pop(0).result()
                in_flight.append(region.read_async(staging[i % streams], offset))
            for read in in_flight:
                read.result()

        seconds = best_seconds(read_all, torch.device("cpu"), 0.0, max_repeats=3, deadline=deadline)
    finally:
        disk.close()
    return len(offsets) * stage / seconds, {"bytes": len(offsets) * stage, "seconds": seconds,
                                            "read_bytes": stage, "streams": streams}


@contextmanager
def copies_streaming(compute: torch.device, nbytes: int):
    """Pinned host-to-GPU copies of ``nbytes`` looping on a thread while the block runs; yields a
    one-item list counting the copies finished so far."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device=compute)
    stream = torch.cuda.Stream(compute)
    stop, done = threading.Event(), [0]

    def copy_loop():
        # Several copies per wake-up, then a wait that sleeps without the GIL and without spinning:
        # a spinning thread takes a core from the measured work, which the runtime's copies
        # (waited on by the GPU, not the host) never do.
        finished = torch.cuda.Event(blocking=True)
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for _ in range(8):
                    device.copy_(host, non_blocking=True)
                finished.record(stream)
                finished.synchronize()
                done[0] += 8

    worker = threading.Thread(target=copy_loop)
    worker.start()
    try:
        yield done
    finally:
        stop.set()
        worker.join()


def _cpu_attention_share_under_copy(sizes: ProfileSizes, compute: torch.device, rows: int, alone: float,
                                    deadline: Deadline | None = None):
    """CPU attention's speed over ``rows`` sequences while pinned host-to-GPU copies stream, as a
    share of its speed without them (``alone`` seconds)."""
    nbytes = max(sizes.copy_bytes)
    with copies_streaming(compute, nbytes):
        together = cpu_attention_seconds(rows, sizes, deadline=deadline)
    share = min(1.0, alone / together)
    return share, {"rows": rows, "alone_seconds": alone, "under_copy_seconds": together, "copy_bytes": nbytes}


def _step_weights(use_cuda: bool, gpu_count: int) -> dict[str, float]:
    """A profile's measurements in order, each with its share of the time budget (about its share of
    an unhurried profile's time)."""
    weights = {"copies": 0.05, "copies to all GPUs": 0.02, "disk": 0.05, "matmuls": 0.08, "attention": 0.08,
               "dequantization": 0.1, "host time": 0.5, "routed experts": 0.3, "CPU attention under copies": 0.03}
    if gpu_count < 2:
        del weights["copies to all GPUs"]
    if not use_cuda:
        del weights["routed experts"], weights["CPU attention under copies"]
    return weights


@dataclass
class _Profiling:
    """What every measurement of one profile shares: the request, the time budget, and the raw
    measurements and notes recorded so far (in the order they are measured)."""
    quick: bool
    use_cuda: bool
    sizes: ProfileSizes
    disk_dir: str
    gpu_count: int
    budget: Budget
    log: Callable[[str], None]
    measurements: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    @property
    def cpu(self) -> torch.device:
        return torch.device("cpu")

    @property
    def compute(self) -> torch.device:
        return torch.device("cuda") if self.use_cuda else self.cpu

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16 if self.use_cuda else torch.float32


def _checked_request(quick: bool, disk_dir: str | None, device: str | None):
    """(use_cuda, sizes, disk_dir, its free bytes) of a request, or the one line saying why it
    cannot be measured."""
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    sizes = (QUICK_GPU if use_cuda else QUICK) if quick else FULL
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available on this machine")
    disk_dir = disk_dir or tempfile.gettempdir()
    if not os.path.isdir(disk_dir):
        raise ConfigError(f"--disk-dir {disk_dir}: not a directory")
    disk_free = shutil.disk_usage(disk_dir).free
    free_disk_needed = sizes.disk_bytes + DISK_BLOCK
    if disk_free < free_disk_needed:
        raise ConfigError(f"--disk-dir {disk_dir}: needs {free_disk_needed} free bytes to profile, has {disk_free}")
    return use_cuda, sizes, disk_dir, disk_free


def _gpu_copies(run: _Profiling, deadline: Deadline) -> dict:
    """The GPU's memory and its links to the host: pinned copies each way, and to all GPUs at once."""
    compute, measurements = run.compute, run.measurements
    properties = torch.cuda.get_device_properties(compute)
    ram = psutil.virtual_memory().total
    run.log(f"profiling {properties.name} with pinned copies")
    to_gpu, measurements["cpu_to_gpu"] = _copy_bandwidth(run.cpu, compute, run.sizes, pinned=True, deadline=deadline)
    to_cpu, measurements["gpu_to_cpu"] = _copy_bandwidth(compute, run.cpu, run.sizes, pinned=True, deadline=deadline)
    run.notes["bandwidth_bytes_per_s"] = "measured: pinned copies at several sizes, fit to latency + bytes / bandwidth"
    to_all = None
    if run.gpu_count > 1:
        run.budget.start("copies to all GPUs")
        run.log(f"copying to all {run.gpu_count} GPUs at once")
        to_all = measurements["cpu_to_all_gpus"] = all_gpus_bandwidth(run.gpu_count, run.sizes.copy_bytes[-1])
    return dict(gpu_memory=int(properties.total_memory), cpu_memory=int(ram),
                device=f"{properties.name}, {os.cpu_count()} cores",
                cpu_to_gpu_bandwidth=to_gpu, gpu_to_cpu_bandwidth=to_cpu, cpu_to_all_gpus_bandwidth=to_all)


def _cpu_copies(run: _Profiling, deadline: Deadline) -> dict:
    """Without CUDA: RAM split into the gpu tier's budget and the cpu tier, and RAM-to-RAM copies
    standing for both directions of the GPU's link."""
    ram = psutil.virtual_memory().total
    gpu_memory = int(ram * CPU_ONLY_GPU_BUDGET)
    run.log("no CUDA: profiling the CPU as the compute device")
    to_gpu, run.measurements["cpu_to_gpu"] = _copy_bandwidth(run.cpu, run.cpu, run.sizes, pinned=False,
                                                             deadline=deadline)
    run.measurements["gpu_to_cpu"] = run.measurements["cpu_to_gpu"]
    run.notes["memory_bytes"] = f"no CUDA: the gpu tier is {CPU_ONLY_GPU_BUDGET:.0%} of RAM, the cpu tier the rest"
    run.notes["bandwidth_bytes_per_s"] = ("measured: RAM-to-RAM copies (both 'PCIe' directions), fit to "
                                          "latency + bytes / bandwidth; disk measured")
    return dict(gpu_memory=int(gpu_memory), cpu_memory=int(ram - gpu_memory),
                device=f"CPU only ({os.cpu_count()} cores); the gpu tier is a RAM budget",
                cpu_to_gpu_bandwidth=to_gpu, gpu_to_cpu_bandwidth=to_gpu, cpu_to_all_gpus_bandwidth=None)


def _copies(run: _Profiling) -> dict:
    """The memory of each tier, and the copies between the host and the compute device."""
    deadline = run.budget.start("copies")
    return (_gpu_copies if run.use_cuda else _cpu_copies)(run, deadline)


def _disk(run: _Profiling) -> dict:
    """The disk's reads and writes past the page cache, and the disk tier's reads through it."""
    deadline = run.budget.start("disk")
    sizes, disk_dir, measurements = run.sizes, run.disk_dir, run.measurements
    run.log(f"disk: {sizes.disk_bytes // MiB} MiB in {DISK_BLOCK // MiB} MiB blocks under {disk_dir}")
    disk_read, disk_write, measurements["disk"] = _disk_bandwidth(disk_dir, sizes.disk_bytes)
    cached_read, measurements["disk_cached_read"] = cached_read_bandwidth(disk_dir, sizes.disk_bytes // 2,
                                                                          deadline=deadline)
    if run.use_cuda:
        # Weights read from disk then cross to the GPU, so the reads share host memory with pinned
        # copies of the stage before: time them that way, and keep the lone figure beside it.
        with copies_streaming(run.compute, max(sizes.copy_bytes)):
            cached_read, measurements["disk_cached_read_under_copy"] = cached_read_bandwidth(
                disk_dir, sizes.disk_bytes // 2, deadline=deadline)
    return dict(disk_to_cpu_bandwidth=disk_read, cpu_to_disk_bandwidth=disk_write,
                disk_to_cpu_cached_bandwidth=cached_read)


def _kernels(run: _Profiling) -> dict:
    """The compute kernels: matmuls by row count, attention (and CPU attention), dequantization and
    the cache's quantization."""
    compute, dtype, sizes, measurements = run.compute, run.dtype, run.sizes, run.measurements
    deadline = run.budget.start("matmuls")
    run.log("matmuls at several row counts")
    curve, measurements["matmul"] = matmul_curve(compute, dtype, sizes, deadline)
    run.notes["matmul_flop_per_s"] = (f"measured: {str(dtype).replace('torch.', '')} [m x {sizes.matmul_inner}] . "
                                      f"[{sizes.matmul_inner} x {sizes.matmul_outer}]; fit: running maximum over m, "
                                      "interpolated log-log between the points")
    deadline = run.budget.start("attention")
    run.log("attention and dequantization")
    attention = attention_rates(compute, dtype, sizes, deadline=deadline)
    measurements["attention"] = attention.pop("raw")
    cpu_attention, cpu_attention_call, measurements["cpu_attention"] = cpu_attention_rate(sizes, deadline=deadline)
    deadline = run.budget.start("dequantization")
    gpu_dequant, measurements["gpu_dequant"] = dequant_rate(compute, sizes, deadline=deadline)
    kv_dequant, measurements["gpu_kv_dequant"] = dequant_rate(compute, sizes, shape=(32, 8, 128), deadline=deadline)
    kv_quant, measurements["gpu_kv_quant"] = kv_quant_rate(compute, dtype, sizes, deadline=deadline)
    if run.use_cuda:
        # a quick profile's CPU sizes: quantizing a GPU's (256 Mi elements) on the CPU takes seconds
        cpu_dequant, measurements["cpu_dequant"] = dequant_rate(run.cpu, QUICK if run.quick else sizes,
                                                                deadline=deadline)
    else:
        cpu_dequant = gpu_dequant
    return dict(matmul_flops=tuple((float(m), float(f)) for m, f in curve),
                prefill_attention_flops=attention["prefill_attention_flop_per_s"],
                decode_attention_flops=attention["decode_attention_flop_per_s"],
                gpu_memory_bandwidth=attention["gpu_memory_bytes_per_s"],
                cpu_attention_flops=cpu_attention, cpu_attention_seconds_per_call=cpu_attention_call,
                gpu_dequant_throughput=gpu_dequant, cpu_dequant_throughput=cpu_dequant,
                gpu_kv_dequant_throughput=kv_dequant, gpu_kv_quant_throughput=kv_quant)


def _host_time(run: _Profiling) -> dict:
    """The runtime's host time per layer and per step, and its extras."""
    deadline = run.budget.start("host time")
    run.log("the runtime's host time per layer")
    host_layer, host_step, host_extras, run.measurements["host_overhead"] = host_overhead(
        run.compute, run.dtype, offload_dir=run.disk_dir, batches=GPU_BATCHES if run.use_cuda else 1,
        deadline=deadline, **(QUICK_HOST_PROBE if run.quick else {}))
    return dict(host_seconds_per_layer=host_layer, host_seconds_per_step=host_step, **host_extras)


def _routed_experts(run: _Profiling) -> dict:
    """A GPU profile's routed experts, each mixture-of-experts shape's; none on the CPU. A quick
    profile measures them too: without them the planner prices experts at the dense rate, and a
    quick profile's Qwen3-30B-A3B prefill came out 36-38% faster than it ran (H200, 2026-12-06)."""
    if not run.use_cuda:
        return dict(sparse_mlp_flops=())
    compute = run.compute
    run.budget.start("routed experts")
    run.log("the routed experts of each mixture-of-experts shape")
    # bfloat16: the mixtures' own dtype, which dtype auto runs them in on a GPU.
    sparse, run.measurements["sparse_mlp"] = measure_sparse_rates(
        compute, torch.bfloat16, lambda fn: best_seconds(fn, compute, run.sizes.min_seconds), log=run.log)
    run.notes["sparse_mlp_flop_per_s"] = ("measured: a sparse layer's routed experts as the runtime runs them "
                                          "(routing, sort by expert, grouped matmuls, weighted sum), bfloat16, random "
                                          "weights, each expert shape of the registry; FLOP/s of the experts a token "
                                          "is routed to, by tokens routed together")
    return dict(sparse_mlp_flops=sparse)


def _cpu_attention_under_copies(run: _Profiling) -> dict:
    """On a GPU machine, CPU attention's share of its speed left while pinned copies stream."""
    share_under_copy = 1.0
    if run.use_cuda:
        deadline = run.budget.start("CPU attention under copies")
        run.log("CPU attention while pinned copies stream")
        timed = run.measurements["cpu_attention"]
        share_under_copy, run.measurements["cpu_attention_under_copy"] = _cpu_attention_share_under_copy(
            run.sizes, run.compute, timed["rows"][-1], timed["seconds"][-1], deadline)
    return dict(cpu_attention_share_under_copy=share_under_copy)


def _note_what_was_measured(notes: dict, measurements: dict) -> None:
    notes["compute"] = ("measured: the runtime's attention (32 heads x 128; prefill of 512 with a causal and padding "
                        "mask, decode with softmax and bmm over 544 keys), the runtime's CPU attention over an fp16 "
                        "cache, alone and while pinned copies to the GPU stream, 4-bit group-64 dequantization of "
                        "weight rows and of KV rows (head_dim 128), quantization of a prefill's keys into a slot-major "
                        "cache, a device-to-device copy for memory bandwidth")
    notes["disk_to_cpu_cached"] = ("measured: the disk tier's reads of a file it has just written (page cache), two "
                                   "stages in flight as the weight store keeps them, while pinned copies to the GPU "
                                   "stream (the figure without them is kept in measurements)")
    batches, (low, high) = measurements["host_overhead"]["gpu_batches"], measurements["host_overhead"]["depths"]
    notes["host_seconds"] = (f"measured: decode of {batches} GPU batch(es) of one sequence through the runtime on "
                             f"128-wide OPT models of {low} and {high} layers, all on the device, with the cache travelling "
                             f"(plain and 4-bit, and 4-bit on disk over {DISK_BATCHES} batches), and with 4-bit weights; and on "
                             "Llama-family models alike, dense and with 8 experts (2 a token); fit: the slope per "
                             "batch is per layer and batch, the intercept per batch and step, the extras are "
                             "differences of slopes (4-bit weights': per pass over a layer)")


def profile_machine(quick: bool = False, disk_dir: str | None = None, device: str | None = None,
                    log=lambda message: None, progress=None) -> HardwareProfile:
    """Measure this machine. ``device`` "cuda" or "cpu" overrides the automatic choice. A quick
    profile keeps to its sizes' time budget; ``progress(fraction, step)`` hears each measurement
    start (``Budget`` says how), and the end."""
    use_cuda, sizes, disk_dir, disk_free = _checked_request(quick, disk_dir, device)
    gpu_count = torch.cuda.device_count() if use_cuda else 1
    budget = Budget(sizes.budget_seconds, _step_weights(use_cuda, gpu_count), progress)
    run = _Profiling(quick, use_cuda, sizes, disk_dir, gpu_count, budget, log)
    figures = {}
    # in the order of _step_weights: each measurement starts its share of the budget
    for measure in (_copies, _disk, _kernels, _host_time, _routed_experts, _cpu_attention_under_copies):
        figures.update(measure(run))
    budget.finish()
    _note_what_was_measured(run.notes, run.measurements)
    return HardwareProfile(
        name=f"measured-{'cuda' if use_cuda else 'cpu'}", disk_memory=int(disk_free), gpu_count=gpu_count,
        usable_fraction=(0.9, 0.85, 0.9), pinned_host_memory=use_cuda,
        source=f"measured by `flexoff profile{' --quick' if quick else ''}` on {time.strftime('%Y-%m-%d')}",
        notes=run.notes, measurements=run.measurements, **figures,
    )


def disk_measure_error(disk_dir: str | None, exc: OSError) -> ConfigError:
    """The one line for a disk that cannot be measured: it is measured by writing files under
    ``disk_dir``, and the disk may fill up meanwhile."""
    where = disk_dir or tempfile.gettempdir()
    return ConfigError(f"cannot measure the disk under {where} ({exc.strerror or exc}); free some space, or "
                       "pass --disk-dir on another disk")


def saved_or_measured_profile(device: torch.device, disk_dir: str | None, log: Callable[[str], None],
                              progress: Callable[[float, str | None], None] | None = None) -> HardwareProfile:
    """This machine's saved profile; measured quickly and saved there first when there is none
    (``progress``: as ``profile_machine`` takes it)."""
    path = default_profile_path()
    if path.is_file():
        return HardwareProfile.load(path)
    log(f"no hardware profile saved at {path}: measuring a quick one (`flexoff profile` measures a full one)")
    started = time.perf_counter()
    try:
        profile = profile_machine(quick=True, disk_dir=disk_dir, device=device.type, progress=progress)
    except OSError as exc:
        raise disk_measure_error(disk_dir, exc) from None
    try:
        profile.save(path)
    except OSError as exc:
        log(f"could not save the hardware profile to {path}: {exc.strerror or exc}")
    else:
        log(f"measured in {time.perf_counter() - started:.0f} s, saved to {path}")
    return profile
