"""Storage tiers below the compute device: host memory (pinned where CUDA exists) and disk files.

Also the small stream/event abstraction the executor uses: on CUDA, copies run on their own
streams ordered by events; on a machine without CUDA the same calls run in place.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import sys
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from pathlib import Path

import torch

from ..errors import PolicyError
from ..units import format_size
from ..layout.host import (HOST_CHUNK, HOST_JOBS_IN_FLIGHT, PAGE, SlabPlan, disk_file_bytes, pages,
                           pins_host_memory)
from .offload_dir import make_private_folder

HUGE_PAGE = 2 << 20
HUGE_PAGE_MIN = 32 << 20  # smaller ones stay in small pages, where a huge page would be mostly padding
MADV_HUGEPAGE = 14  # Linux's value

_CHUNK = 64 << 20  # bytes per read/write call: large enough for full disk bandwidth


def device_allocator(device: torch.device | str):
    """allocate(shape, dtype) -> an uninitialised tensor on ``device`` (the host allocator's twin)."""

    def allocate(shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, device=device, dtype=dtype)

    return allocate


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _DeviceView:
    """``__cuda_array_interface__`` over pinned host bytes: with unified addressing the host pointer
    of pinned memory is valid on the device."""

    def __init__(self, pointer: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "strides": None, "version": 3}


def read_pinned(target: torch.Tensor, source: torch.Tensor) -> None:
    """Fill ``target`` on the compute device from the host tensor ``source``, after the work
    enqueued so far on the current stream.

    A pinned source on CUDA is read by a kernel over PCIe, not by a copy engine: the engine serves
    host-to-device copies in the order they were issued, whatever their stream, so a small copy on
    the compute stream would wait behind the load stream's next layer of weights (measured: 150 KB
    waited 17 ms behind a 1 GiB copy). The kernel is an integer multiply by one over the same bytes,
    which copies every bit pattern exactly.
    """
    if target.device.type != "cuda" or not source.is_pinned() or not (source.is_contiguous() and target.is_contiguous()):
        target.copy_(source, non_blocking=True)
        return
    nbytes = source.numel() * source.element_size()
    alias = torch.as_tensor(_DeviceView(source.data_ptr(), nbytes), device=target.device)
    integer = _SAME_SIZE_INTEGER[source.element_size()]
    torch.mul(alias.view(integer).view(source.shape), 1, out=target.view(integer))


class HostMemory:
    """Host allocations of one lifetime (the engine's weights, or one block's cache).

    Pinned memory (where CUDA exists) lets copies to the GPU run asynchronously. The CUDA host
    allocator rounds every request up to a power of two (18 GB of KV cache became 32 GB), so it is
    never asked for a tensor on its own:

    - ``exact`` allocations are plain host memory, registered with CUDA at its own size, a
      page-aligned buffer per request. For the weights, allocated once for the engine's life: slabs
      would leave 6% of OPT-30B's unused, 19% of OPT-175B's, and up to half when a stage's host
      part is one odd-sized matrix. torch's ``is_pinned()`` does not report such memory, so
      ``read_pinned`` copies from it instead of reading it by kernel.
    - Otherwise requests are carved out of slabs of that allocator (see :class:`SlabPlan`). For a
      block's cache: the allocator keeps freed slabs for the next block, which then pins nothing
      anew, and uniform cache tensors leave only a few percent of each slab unused.
    """

    def __init__(self, pin: bool, exact: bool = False):
        self.pin = pins_host_memory(pin)
        self.exact = exact and self.pin
        self._plan = SlabPlan()
        self._slabs: list[torch.Tensor] = []
        self._registered: list[torch.Tensor] = []  # held here until unregistered
        self._unregister = weakref.finalize(self, _unregister, self._registered)
        self.nbytes = 0

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        self.nbytes += nbytes
        if not self.pin:
            return torch.empty(shape, dtype=dtype)
        if self.exact:
            return self._register(nbytes)[:nbytes].view(dtype).view(shape)
        index, start = self._plan.place(nbytes)
        if index == len(self._slabs):
            self._slabs.append(torch.empty(self._plan.slabs[index][0], dtype=torch.uint8, pin_memory=True))
        return self._slabs[index][start:start + nbytes].view(dtype).view(shape)

    def _register(self, nbytes: int) -> torch.Tensor:
        # Whole pages of its own: two registrations must never share a page.
        size = pages(nbytes)
        buffer = touched_pages(size)
        error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 0))
        if error:
            raise PolicyError(f"cannot pin {format_size(size)} of host memory (CUDA error {error}); run without "
                              "pinning (--no-pin, or pin_cpu_memory false in the policy)")
        self._registered.append(buffer)
        return buffer

    def close(self) -> None:
        self._unregister()
        self._slabs.clear()


def touched_pages(size: int) -> torch.Tensor:
    """``size`` bytes (whole pages) of zeroed host memory on pages of their own, huge pages from
    HUGE_PAGE_MIN up, faulted in on every thread."""
    align = HUGE_PAGE if size >= HUGE_PAGE_MIN else PAGE
    base = torch.empty(size + align, dtype=torch.uint8)  # the slack is address space, never touched
    buffer = base[-base.data_ptr() % align:][:size]
    if align == HUGE_PAGE:
        advise_huge_pages(buffer)
    # Registering faults the pages in on one thread (2.2 GB/s on the H200 machine); touched on
    # every thread first, and in huge pages, 4 GiB registered at 19 GB/s.
    buffer.zero_()
    return buffer


def advise_huge_pages(buffer: torch.Tensor) -> None:
    """Ask Linux to back ``buffer`` (2 MiB aligned) with transparent huge pages: a 512th of the page
    faults, and of the pages to pin. Only a hint: where the kernel or the libc has no such advice,
    nothing changes."""
    libc = _libc()
    if libc is not None:
        libc.madvise(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.numel() * buffer.element_size()),
                     MADV_HUGEPAGE)


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def _unregister(buffers: list[torch.Tensor]) -> None:
    """Unpin registered host memory, once no copy can still be reading it."""
    if buffers:
        torch.cuda.synchronize()
        for buffer in buffers:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        buffers.clear()


class Streams:
    """Compute, load and store streams on CUDA; plain in-order calls elsewhere.

    Weights and the travelling cache load on streams of their own: a stage's weight load (issued
    with its first batch) would otherwise hold every later batch's cache load of the stage behind
    it, and with them the batches' compute, and the next weight load waits for that compute.
    """

    def __init__(self, device: torch.device, overlap: bool):
        self.cuda = device.type == "cuda"
        self.overlap = overlap and self.cuda
        if self.overlap:
            self.compute = torch.cuda.current_stream(device)
            self.load = torch.cuda.Stream(device)
            self.cache = torch.cuda.Stream(device)
            self.store = torch.cuda.Stream(device)
        else:
            self.compute = self.load = self.cache = self.store = None

    def on(self, stream):
        """Context manager running enqueued work on ``stream`` (a no-op without overlap)."""
        return torch.cuda.stream(stream) if stream is not None else _Nothing()

    def record(self, stream) -> "torch.cuda.Event | None":
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        """Make ``stream`` wait for ``event`` without blocking the host."""
        if stream is not None and event is not None:
            stream.wait_event(event)


class StoreQueue:
    """Device-to-host stores enqueued on the store stream, each keeping its GPU inputs alive until
    its event has passed.

    The host waits for the oldest once the stores in flight hold more than HOST_JOBS_IN_FLIGHT
    times the largest store seen: a prefill's, for which the memory estimate reserves that much, as
    for the host worker's jobs. A decode step's stores are a slot each, so the host never waits on
    them and runs ahead of the GPU as far as its other limits let it.
    """

    def __init__(self):
        self._queue: deque = deque()  # (event, bytes held)
        self._held = 0
        self._largest = 0
        # The most bytes held by stores not yet seen to have passed: the memory estimate reserves
        # HOST_JOBS_IN_FLIGHT prefills' worth; this says how much of it a run used.
        self.peak = 0

    def add(self, event, nbytes: int) -> None:
        self._largest = max(self._largest, nbytes)
        self._queue.append((event, nbytes))
        self._held += nbytes
        while self._queue and (self._held > HOST_JOBS_IN_FLIGHT * self._largest or self._queue[0][0].query()):
            oldest, size = self._queue.popleft()
            oldest.synchronize()
            self._held -= size
        self.peak = max(self.peak, self._held)


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class HostWorker:
    """One thread for host-side cache work: placing new keys and values in host caches, and CPU
    attention; and a few reading disk rows in for GPU attention, each enqueuing the copy of what it
    read to the GPU.

    The main thread only enqueues GPU work and records an event; a job waits for that event on the
    store stream, so the host work of one GPU batch runs while the GPU computes the others. Being
    one thread, jobs run in submission order: a job that reads a layer's host cache sees every
    earlier write to it. Reads of disk rows wait for the job that wrote them, and for the copy
    that last used their staging pair (kv.BatchKV).
    """

    MAX_IN_FLIGHT = HOST_JOBS_IN_FLIGHT  # a job keeps its GPU inputs (a layer's keys at prefill) alive until it has run
    READERS = 4  # threads reading disk rows
    CHUNK = HOST_CHUNK  # bytes of each of the two pinned chunks a strided host write goes through

    def __init__(self, device: torch.device, streams: Streams, pin: bool):
        self.device = device
        self.streams = streams
        self.pin = pins_host_memory(pin)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flexoff-host")
        # Reads of disk rows for GPU attention run on threads of their own: they wait for nothing
        # on the GPU, so queued behind jobs that do, they would hold up the batch they load. Several
        # at once (batches, and a layer read ahead) keep the drive's queue deep enough to stream.
        self._reader = ThreadPoolExecutor(max_workers=self.READERS, thread_name_prefix="flexoff-host-read")
        self._jobs: deque[Future] = deque()
        self._reads: deque[Future] = deque()
        self._chunks: list[torch.Tensor] = []

    def submit(self, fn, ready) -> Future:
        """Run ``fn()`` on the worker once the event ``ready`` has passed (None: no wait needed)."""
        while self._jobs and (self._jobs[0].done() or len(self._jobs) >= self.MAX_IN_FLIGHT):
            self._jobs.popleft().result()  # a failed job's error surfaces here, on the main thread
        future = self._pool.submit(self._run, [fn], ready)
        self._jobs.append(future)
        return future

    def read(self, fn) -> Future:
        """Run ``fn()`` on a reader thread (reads run side by side)."""
        return self._track(self._reader.submit(self._run, [fn], None))

    def after(self, first: Future, fn) -> Future:
        """Run ``fn()`` as soon as ``first`` is done: on the thread that finishes it, or here if it
        already has. A hand-over to another thread would cost each read a wake-up and a turn at
        the interpreter, which the main thread needs to keep the GPU fed."""
        future: Future = Future()
        job = [fn]

        def run(done: Future) -> None:
            try:
                done.result()
                future.set_result(self._run(job, None))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the future
                job.clear()
                future.set_exception(exc)

        first.add_done_callback(run)
        return self._track(future)

    def _track(self, future: Future) -> Future:
        while self._reads and self._reads[0].done():
            self._reads.popleft().result()  # a failed read's error surfaces here, on the main thread
        self._reads.append(future)
        return future

    def _run(self, job: list, ready):
        """Run the one function in ``job``, taken out of it first. A pool's thread (and ``first``'s
        callbacks, for ``after``) hold the job past its future's end, and a job's closure holds its
        block's cache: taken out, the function goes as it returns, and the cache with the block."""
        fn = job.pop()
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()
        with device, self.streams.on(self.streams.store):
            self.streams.wait(self.streams.store, ready)
            return fn()

    def drain(self) -> None:
        """Wait for every job, then raise the first failure, if any."""
        jobs, self._jobs = [*self._jobs, *self._reads], deque()
        self._reads = deque()
        wait(jobs)
        for job in jobs:
            job.result()

    def copy_to_host(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` (on the compute device) into the host tensor ``target``; worker thread only.

        A strided host target is not filled straight from the GPU (that copy runs as a kernel
        touching host memory element by element, or through a pageable copy of the whole tensor):
        it goes through two pinned chunks, so the host places one while the next crosses PCIe.
        """
        if target.is_contiguous() or not source.is_cuda:
            target.copy_(source)
        else:
            self.staged_copy(target, source)

    def staged_copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        asynchronous = self.streams.store is not None  # without a store stream, copies must block
        previous = None
        for index, (into, piece) in enumerate(_pieces(target, source, self.CHUNK)):
            landing = self._chunk(index % 2, into)
            landing.copy_(piece, non_blocking=asynchronous)
            current = (into, landing, self.streams.record(self.streams.store))
            if previous is not None:
                _place(*previous)
            previous = current
        if previous is not None:
            _place(*previous)

    def _chunk(self, index: int, like: torch.Tensor) -> torch.Tensor:
        while len(self._chunks) <= index:
            # A power of two: the CUDA host allocator rounds every pinned request up to one.
            self._chunks.append(torch.empty((self.CHUNK,), dtype=torch.uint8, pin_memory=self.pin))
        nbytes = like.numel() * like.element_size()
        return self._chunks[index][:nbytes].view(like.dtype).view(like.shape)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._jobs.clear()
        self._chunks.clear()


def _pieces(target: torch.Tensor, source: torch.Tensor, limit: int):
    """Matching views of ``target`` and ``source`` of at most ``limit`` bytes each, cut along the
    leading dimensions."""
    size = target.numel() * target.element_size()
    if size <= limit:
        yield target, source
        return
    per_entry = size // target.shape[0]
    if per_entry > limit:
        for index in range(target.shape[0]):
            yield from _pieces(target[index], source[index], limit)
        return
    step = limit // per_entry
    for start in range(0, target.shape[0], step):
        yield target[start:start + step], source[start:start + step]


def _place(target: torch.Tensor, landing: torch.Tensor, copied) -> None:
    if copied is not None:
        copied.synchronize()
    target.copy_(landing)


class DiskTier:
    """Tensors in files inside a private offload directory, read and written by a thread pool.

    The directory is created with mode 0700 and removed, with everything in it, by ``close()``;
    one left by a process killed outright is removed when the next DiskTier starts in ``base``
    (see offload_dir.py).
    """

    def __init__(self, base: str | Path, threads: int = 4):
        base = Path(base)
        try:
            base.mkdir(parents=True, exist_ok=True)
            self.directory = make_private_folder(base)
        except OSError as exc:
            raise PolicyError(f"cannot create an offload directory in {base}: {exc.strerror or exc}") from None
        # Removes the folder even if the owner is never closed (an exception path, interpreter exit).
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.directory), True)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flexoff-disk")
        self._files: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self.bytes_written = 0

    def allocate(self, name: str, num_bytes: int) -> "DiskRegion":
        """Reserve a file of ``num_bytes`` (rounded up to whole pages)."""
        path = self.directory / name
        if name in self._files:  # a later block reuses the name: drop the old file's handle
            os.close(self._files.pop(name))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        size = disk_file_bytes(num_bytes)
        os.ftruncate(fd, size)
        self._files[name] = fd
        self._sizes[name] = size
        return DiskRegion(self, fd, num_bytes)

    @property
    def bytes_reserved(self) -> int:
        return sum(self._sizes.values())

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        self._finalizer()


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous host tensor, whatever its dtype. A view made once and sliced
    later spares a thread that reads or writes the same buffer many times its calls into torch."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


class DiskRegion:
    """One file of the disk tier, holding tensor bytes at offsets the caller chooses."""

    def __init__(self, tier: DiskTier, fd: int, num_bytes: int):
        self.tier = tier
        self.fd = fd
        self.num_bytes = num_bytes

    def write(self, tensor: torch.Tensor, offset: int = 0) -> None:
        self.write_bytes(host_bytes(tensor.contiguous()), offset)

    def write_bytes(self, data: memoryview, offset: int = 0) -> None:
        for start in range(0, len(data), _CHUNK):
            chunk = data[start:start + _CHUNK]
            written = os.pwrite(self.fd, chunk, offset + start)
            if written != len(chunk):
                raise OSError(f"short write to the offload directory ({written} of {len(chunk)} bytes)")
        self.tier.bytes_written += len(data)

    def read_into(self, out: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Fill the contiguous host tensor ``out`` from the file."""
        self.read_bytes(host_bytes(out), offset)
        return out

    def read_bytes(self, data: memoryview, offset: int = 0) -> None:
        for start in range(0, len(data), _CHUNK):
            chunk = data[start:start + _CHUNK]
            got = os.preadv(self.fd, [chunk], offset + start)
            if got != len(chunk):
                raise OSError(f"short read from the offload directory ({got} of {len(chunk)} bytes)")

    def write_async(self, tensor: torch.Tensor, offset: int = 0) -> Future:
        return self.tier.submit(self.write, tensor, offset)

    def read_async(self, out: torch.Tensor, offset: int = 0) -> Future:
        return self.tier.submit(self.read_into, out, offset)
