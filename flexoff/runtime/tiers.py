"""Storage tiers below the compute device: host memory (pinned where CUDA exists) and disk files.

Also the small stream/event abstraction the executor uses: on CUDA, copies run on their own
streams ordered by events; on a machine without CUDA the same calls run in place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import PolicyError

_ALIGN = 4096  # file offsets are page-aligned so large reads map onto whole pages
_CHUNK = 64 << 20  # bytes per read/write call: large enough for full disk bandwidth


def device_allocator(device: torch.device | str):
    """allocate(shape, dtype) -> an uninitialised tensor on ``device`` (the host allocator's twin)."""

    def allocate(shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, device=device, dtype=dtype)

    return allocate


class HostMemory:
    """Host allocations of one lifetime (the engine's weights, or one block's cache).

    Pinned memory (where CUDA exists) lets copies to the GPU run asynchronously. It is carved out of
    large slabs because the CUDA host allocator rounds every request up to a power of two, which
    would waste up to half of each odd-sized tensor: 18 GB of KV cache became 32 GB.
    """

    SLAB = 1 << 30
    ALIGN = 512

    def __init__(self, pin: bool):
        self.pin = pin and torch.cuda.is_available()
        self._slabs: list[list] = []  # [slab tensor, bytes used]
        self.nbytes = 0

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        self.nbytes += nbytes
        if not self.pin:
            return torch.empty(shape, dtype=dtype)
        need = -(-nbytes // self.ALIGN) * self.ALIGN
        slab = next((s for s in self._slabs if s[0].numel() - s[1] >= need), None)
        if slab is None:
            size = max(self.SLAB, 1 << (need - 1).bit_length())
            slab = [torch.empty(size, dtype=torch.uint8, pin_memory=True), 0]
            self._slabs.append(slab)
        start = slab[1]
        slab[1] += need
        return slab[0][start:start + nbytes].view(dtype).view(shape)

    def close(self) -> None:
        self._slabs.clear()


class Streams:
    """Compute, load and store streams on CUDA; plain in-order calls elsewhere."""

    def __init__(self, device: torch.device, overlap: bool):
        self.cuda = device.type == "cuda"
        self.overlap = overlap and self.cuda
        if self.overlap:
            self.compute = torch.cuda.current_stream(device)
            self.load = torch.cuda.Stream(device)
            self.store = torch.cuda.Stream(device)
        else:
            self.compute = self.load = self.store = None

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


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class DiskTier:
    """Tensors in files inside a private offload directory, read and written by a thread pool.

    The directory is created with mode 0700 and removed, with everything in it, by ``close()``.
    """

    def __init__(self, base: str | Path, threads: int = 4):
        base = Path(base)
        try:
            base.mkdir(parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix="flexoff-", dir=base))
        except OSError as exc:
            raise PolicyError(f"cannot create an offload directory in {base}: {exc.strerror or exc}") from None
        os.chmod(self.directory, 0o700)
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
        size = -(-num_bytes // _ALIGN) * _ALIGN
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


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous host tensor, whatever its dtype."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


class DiskRegion:
    """One file of the disk tier, holding tensor bytes at offsets the caller chooses."""

    def __init__(self, tier: DiskTier, fd: int, num_bytes: int):
        self.tier = tier
        self.fd = fd
        self.num_bytes = num_bytes

    def write(self, tensor: torch.Tensor, offset: int = 0) -> None:
        data = _bytes_of(tensor.contiguous())
        for start in range(0, len(data), _CHUNK):
            chunk = data[start:start + _CHUNK]
            written = os.pwrite(self.fd, chunk, offset + start)
            if written != len(chunk):
                raise OSError(f"short write to the offload directory ({written} of {len(chunk)} bytes)")
        self.tier.bytes_written += len(data)

    def read_into(self, out: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Fill the contiguous host tensor ``out`` from the file."""
        data = _bytes_of(out)
        for start in range(0, len(data), _CHUNK):
            chunk = data[start:start + _CHUNK]
            got = os.preadv(self.fd, [chunk], offset + start)
            if got != len(chunk):
                raise OSError(f"short read from the offload directory ({got} of {len(chunk)} bytes)")
        return out

    def write_async(self, tensor: torch.Tensor, offset: int = 0) -> Future:
        return self.tier.submit(self.write, tensor, offset)

    def read_async(self, out: torch.Tensor, offset: int = 0) -> Future:
        return self.tier.submit(self.read_into, out, offset)
