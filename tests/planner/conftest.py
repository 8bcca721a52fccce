"""Shared fixtures: a tiny model and a machine with round numbers, for hand-computed cases."""

import pytest

from flexoff.models.config import ModelConfig
from flexoff.planner.hardware import HardwareProfile


def make_hardware(**changes) -> HardwareProfile:
    values = dict(
        name="round", gpu_memory=10_000, cpu_memory=100_000, disk_memory=1_000_000,
        cpu_to_gpu_bandwidth=100.0, gpu_to_cpu_bandwidth=50.0, disk_to_cpu_bandwidth=10.0,
        cpu_to_disk_bandwidth=5.0, matmul_flops=((1.0, 1000.0),), prefill_attention_flops=500.0,
        decode_attention_flops=20.0, gpu_memory_bandwidth=40.0, cpu_attention_flops=4.0,
        gpu_dequant_throughput=200.0, cpu_dequant_throughput=2.0, usable_fraction=(1.0, 1.0, 1.0),
        pinned_host_memory=False,
    )
    values.update(changes)
    return HardwareProfile(**values)


@pytest.fixture
def tiny_opt() -> ModelConfig:
    # hidden 4, 2 layers, 2 heads of 2, ffn 8, vocab 10, 8 positions
    return ModelConfig(name="tiny-opt", family="opt", vocab_size=10, hidden_size=4, num_layers=2,
                       num_heads=2, intermediate_size=8, max_positions=8)


@pytest.fixture
def tiny_llama() -> ModelConfig:
    # hidden 8, 2 layers, 4 query heads sharing 2 KV heads of 2, ffn 12, vocab 10, untied head
    return ModelConfig(name="tiny-llama", family="llama", vocab_size=10, hidden_size=8, num_layers=2,
                       num_heads=4, num_kv_heads=2, intermediate_size=12, max_positions=64,
                       tie_word_embeddings=False)


@pytest.fixture
def round_hardware() -> HardwareProfile:
    return make_hardware()


@pytest.fixture(name="make_hardware")
def make_hardware_fixture():
    """The factory itself, for tests that change some of the round numbers."""
    return make_hardware
