import numpy as np
import pytest
import torch

from flexoff.errors import ConfigError
from flexoff.profiler import fit_bandwidth, profile_machine


def test_bandwidth_fit_recovers_latency_and_rate():
    sizes = np.array([1e6, 4e6, 16e6, 64e6])
    seconds = 2e-4 + sizes / 5e9
    bandwidth, latency = fit_bandwidth(sizes, seconds)
    assert bandwidth == pytest.approx(5e9, rel=1e-6)
    assert latency == pytest.approx(2e-4, rel=1e-6)


def test_bandwidth_fit_falls_back_when_noise_hides_the_trend():
    bandwidth, latency = fit_bandwidth([1e6, 2e6], [2e-3, 1e-3])
    assert bandwidth == pytest.approx(2e9)
    assert latency == 0


def test_missing_disk_dir_is_a_user_error(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        profile_machine(quick=True, disk_dir=str(tmp_path / "nope"), device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_asking_for_cuda_without_it_is_a_user_error():
    with pytest.raises(ConfigError, match="CUDA is not available"):
        profile_machine(quick=True, device="cuda")
