"""A GPU cap is an object its owner holds: the allocator's fraction is set when it is made and put
back when it is lifted, once (the GPU itself is stood in for: tests/runtime/test_gpu_cap.py runs
the real one)."""

from types import SimpleNamespace

import torch

from flexoff.runtime.memory import DeviceMemoryCap


def test_a_cap_is_set_when_made_and_lifted_once(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=8 << 30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, device: calls.append(
        (fraction, str(device))))
    cap = DeviceMemoryCap.for_device(torch.device("cuda", 1), 2 << 30)
    assert calls == [(0.25, "cuda:1")]
    cap.lift()
    cap.lift()
    assert calls == [(0.25, "cuda:1"), (1.0, "cuda:1")]
    DeviceMemoryCap.for_device(torch.device("cuda", 0), 16 << 30)  # past the card: the whole card
    assert calls[-1] == (1.0, "cuda:0")


def test_nothing_is_capped_on_the_cpu_or_without_a_cap():
    assert DeviceMemoryCap.for_device(torch.device("cpu"), 1 << 30) is None
    assert DeviceMemoryCap.for_device(torch.device("cuda", 0), None) is None
