"""Where the compute device is the CPU, its tier and the cpu tier are one RAM: both are budgeted
from the RAM available (less headroom), the cpu tier's share first, and a run that cannot fit is
refused before anything large is allocated, naming the device as what it is."""

from types import SimpleNamespace

import pytest
import torch

from flexoff import LLM
from flexoff.commands.main import main
from flexoff.errors import PolicyError
from flexoff.runtime import memory
from flexoff.layout import Capacity, check_fits, tier_name
from flexoff.runtime.memory import HOST_HEADROOM, machine_capacity
from flexoff.units import format_size

GiB = 1 << 30


@pytest.fixture
def ram(monkeypatch):
    """Pretend this machine has ``set(n)`` bytes of RAM available."""
    def set_available(nbytes: int) -> None:
        monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: SimpleNamespace(available=nbytes))
    return set_available


def test_on_a_cpu_the_device_tier_shares_the_available_ram(ram):
    ram(10 * GiB)
    capacity = machine_capacity(torch.device("cpu"), None, None, None)
    assert capacity.shared and capacity.gpu is None
    assert capacity.cpu == int(10 * GiB * (1 - HOST_HEADROOM))


def test_the_cpu_tier_is_planned_first_and_the_device_tier_gets_the_rest():
    capacity = Capacity(None, 10 * GiB, None, "cpu")
    check_fits({"gpu": 6 * GiB, "cpu": 4 * GiB, "disk": 0}, capacity, "the job")  # 10 GiB in all: fits
    with pytest.raises(PolicyError) as caught:
        check_fits({"gpu": 6 * GiB, "cpu": 5 * GiB, "disk": 0}, capacity, "the job")
    message = str(caught.value)
    assert "needs 6.00 GiB on the device (cpu) tier, but only 5.00 GiB of RAM is available beside the cpu " \
           "tier's 5.00 GiB (short by 1.00 GiB)" in message
    assert "--percent" in message and "--offload-dir" in message


def test_a_device_cap_on_a_cpu_still_counts_against_the_ram():
    capacity = Capacity(8 * GiB, 10 * GiB, None, "cpu")
    with pytest.raises(PolicyError, match=r"7.00 GiB on the device \(cpu\) tier, but only 6.00 GiB"):
        check_fits({"gpu": 7 * GiB, "cpu": 4 * GiB, "disk": 0}, capacity, "the job")
    with pytest.raises(PolicyError, match=r"9.00 GiB on the device \(cpu\) tier, but only 8.00 GiB is available"):
        check_fits({"gpu": 9 * GiB, "cpu": 0, "disk": 0}, capacity, "the job")


def test_a_gpu_is_named_a_gpu():
    assert tier_name("gpu", torch.device("cuda", 0)) == "gpu"
    assert tier_name("gpu", "cpu") == "device (cpu)"
    assert tier_name("cpu", "cpu") == "cpu"


def test_weights_that_cannot_fit_the_ram_are_refused_before_they_load(ram, monkeypatch):
    ram(200 << 20)  # opt-125m's fp32 weights take 625 MiB
    from flexoff.weights import DummyWeights

    monkeypatch.setattr(DummyWeights, "load_tensor", lambda *a, **k: pytest.fail("a weight was loaded"))
    with pytest.raises(PolicyError, match=r"placing the weights needs .* on the device \(cpu\) tier"):
        LLM("opt-125m", dummy=True)


def test_the_cli_refuses_a_job_whose_cache_cannot_fit_before_loading_anything(ram, monkeypatch, capsys):
    """The weights fit; a block's KV cache (1.2 GiB for 32 x 544 tokens) does not: refused up front."""
    ram(int(1.25 * GiB))
    import flexoff.api.llm

    monkeypatch.setattr(flexoff.api.llm, "Engine", lambda *a, **k: pytest.fail("the engine was built"))
    code = main(["run", "--quiet", "--prompt-len", "512", "--gen-len", "32", "--num-prompts", "64"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("flexoff: error: ")
    assert "opt-125m with a block of 32 sequences of up to 512+32 tokens needs" in err
    assert f"only {format_size(int(1.25 * GiB * (1 - HOST_HEADROOM)))}" in err
    assert "device (cpu) tier" in err
