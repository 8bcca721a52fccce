"""The profiler's host figures from decode timings: per layer and GPU batch, whatever batches it ran."""

import pytest

from flexoff import host_overhead as module

PER_BATCH = {"on the device": 0.4e-3, "travel": 0.3e-3, "compressed cache": 0.2e-3, "llama": 0.1e-3,
             "sparse": 0.05e-3}
WEIGHT_PASS = 1.0e-3  # once per layer, however many batches share the dequantized weights
STEP = 0.7e-3  # per batch and step


def fake_decode(compute, dtype, policy, fields, repeats, sequences=1):
    """Timings of a runtime whose host costs are the figures above."""
    batch = PER_BATCH["on the device"]
    if policy.cache.cpu:
        batch += PER_BATCH["travel"] + (PER_BATCH["compressed cache"] if policy.compress_cache else 0)
    if fields.get("family") == "llama":
        batch += PER_BATCH["llama"] + (PER_BATCH["sparse"] if fields.get("num_experts") else 0)
    layer = policy.num_gpu_batches * batch + (WEIGHT_PASS if policy.compress_weight else 0)
    steps = {depth: depth * layer + policy.num_gpu_batches * STEP for depth in module.DEPTHS}
    return (steps[module.DEPTHS[1]] - steps[module.DEPTHS[0]]) / (module.DEPTHS[1] - module.DEPTHS[0]), steps


@pytest.mark.parametrize("batches", [1, 4])
def test_host_figures_are_per_layer_and_batch_whatever_batches_ran(monkeypatch, batches):
    monkeypatch.setattr(module, "decode_seconds_per_layer", fake_decode)
    per_layer, step, extras, record = module.host_overhead("cuda", None, batches=batches)
    assert per_layer == pytest.approx(PER_BATCH["on the device"])
    assert step == pytest.approx(STEP)
    assert extras["host_seconds_per_travelling_layer"] == pytest.approx(PER_BATCH["travel"])
    assert extras["host_seconds_per_compressed_cache_layer"] == pytest.approx(PER_BATCH["compressed cache"])
    assert extras["host_seconds_per_compressed_weight_layer"] == pytest.approx(WEIGHT_PASS)
    assert extras["host_seconds_per_llama_layer"] == pytest.approx(PER_BATCH["llama"])
    assert extras["host_seconds_per_sparse_layer"] == pytest.approx(PER_BATCH["sparse"])
    assert record["gpu_batches"] == batches
