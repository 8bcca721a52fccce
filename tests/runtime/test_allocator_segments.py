"""The engine's settings of CUDA's allocators. Under a GPU cap, the device's no longer strands
reserved memory: a large block freed and reused in part no longer blocks a later large block that
fits the cap. The pinned host allocator, registering memory it faulted in on many threads, still
gives pinned memory that copies both ways."""

import os
import sys
import textwrap

import pytest
import torch

from flexoff.runtime.memory import configure_cuda_allocators
from tests import processes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# A 3 GiB cap. A 2 GiB block is freed; 1.2 GiB reuses its front, so with fixed segments the 0.8 GiB
# behind it stays reserved and a 1.5 GiB block would take the process past the cap.
PATTERN = textwrap.dedent("""
    import sys, torch
    from flexoff.runtime.memory import configure_cuda_allocators
    GiB = 1 << 30
    torch.cuda.init()
    if sys.argv[1] == "grow":
        configure_cuda_allocators(torch.device("cuda"))
    torch.cuda.set_per_process_memory_fraction(3 * GiB / torch.cuda.get_device_properties(0).total_memory)
    def block(gib):
        return torch.empty(int(gib * GiB), dtype=torch.uint8, device="cuda")
    a = block(2.0); del a
    b = block(1.2)
    try:
        c = block(1.5)
    except torch.OutOfMemoryError:
        print("refused"); sys.exit()
    del c
    try:
        d = block(2.0)  # 1.2 + 2.0 GiB: past the cap, whatever the segments
    except torch.OutOfMemoryError:
        print("fits, cap held"); sys.exit()
    print("fits, cap broken")
""")


def _pattern(mode: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    done = processes.run([sys.executable, "-c", PATTERN, mode], env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.gpu
@needs_cuda
def test_fixed_segments_strand_the_freed_remainder():
    assert _pattern("fixed") == "refused"


@pytest.mark.gpu
@needs_cuda
def test_growing_segments_fit_the_block_and_keep_the_cap():
    assert _pattern("grow") == "fits, cap held"


PINNED = textwrap.dedent("""
    import torch
    from flexoff.runtime.memory import configure_cuda_allocators
    print(configure_cuda_allocators(torch.device("cuda")) is not None)
    host = torch.empty(48 << 20, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
    device = host.to("cuda", non_blocking=True)
    back = torch.empty(host.shape, dtype=torch.uint8, pin_memory=True)
    back.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    print(host.is_pinned(), back.is_pinned(), torch.equal(host, back))
""")


@pytest.mark.gpu
@needs_cuda
def test_pinned_memory_registered_on_many_threads_is_pinned_and_copies():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    done = processes.run([sys.executable, "-c", PINNED], env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True", "True"]


def test_the_users_allocator_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    assert configure_cuda_allocators(torch.device("cuda")) is None
    assert calls == []


def test_a_cpu_device_is_left_alone(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setattr("os.cpu_count", lambda: 24)
    assert configure_cuda_allocators(torch.device("cpu")) is None
    assert calls == []
    made = configure_cuda_allocators(torch.device("cuda"))
    assert calls == [made]
    assert made.split(",") == ["expandable_segments:True", "pinned_use_cuda_host_register:True",
                               "pinned_num_register_threads:16"]
