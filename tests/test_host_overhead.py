"""The profiler's host figures from decode timings: per layer and GPU batch, whatever batches it ran."""

import pytest

from flexoff.profiler import host_overhead as module

PER_BATCH = {"on the device": 0.4e-3, "travel": 0.3e-3, "compressed cache": 0.2e-3, "disk": 1.5e-3,
             "llama": 0.1e-3, "sparse": 0.05e-3}
WEIGHT_PASS = 1.0e-3  # once per layer, however many batches share the dequantized weights
STEP = 0.7e-3  # per batch and step


def layer_seconds(policy, fields):
    """One layer's host seconds for all the policy's batches, in a runtime whose costs are above."""
    batch = PER_BATCH["on the device"]
    if not policy.cache.gpu:
        batch += PER_BATCH["travel"] + (PER_BATCH["compressed cache"] if policy.compress_cache else 0)
        batch += PER_BATCH["disk"] if policy.cache.disk else 0
    if fields.get("family") == "llama":
        batch += PER_BATCH["llama"] + (PER_BATCH["sparse"] if fields.get("num_experts") else 0)
    return policy.num_gpu_batches * batch + (WEIGHT_PASS if policy.compress_weight else 0)


def fake_cases(compute, dtype, cases, repeats, offload_dir, *timing):
    timed = {}
    for name, (policy, fields, sequences) in cases.items():
        assert sequences == policy.num_gpu_batches * policy.gpu_batch_size
        steps = {d: d * layer_seconds(policy, fields) + policy.num_gpu_batches * STEP for d in module.DEPTHS}
        low, high = module.DEPTHS
        timed[name] = ((steps[high] - steps[low]) / (high - low), steps)
    return timed


@pytest.mark.parametrize("batches", [1, 2, module.DISK_BATCHES])
def test_host_figures_are_per_layer_and_batch_whatever_batches_ran(monkeypatch, batches):
    monkeypatch.setattr(module, "decode_seconds_by_case", fake_cases)
    per_layer, step, extras, record = module.host_overhead("cuda", None, batches=batches)
    assert per_layer == pytest.approx(PER_BATCH["on the device"])
    assert step == pytest.approx(STEP)
    assert extras["host_seconds_per_travelling_layer"] == pytest.approx(PER_BATCH["travel"])
    assert extras["host_seconds_per_compressed_cache_layer"] == pytest.approx(PER_BATCH["compressed cache"])
    assert extras["host_seconds_per_disk_rows_layer"] == pytest.approx(PER_BATCH["disk"])
    assert extras["host_seconds_per_compressed_weight_layer"] == pytest.approx(WEIGHT_PASS)
    assert extras["host_seconds_per_llama_layer"] == pytest.approx(PER_BATCH["llama"])
    assert extras["host_seconds_per_sparse_layer"] == pytest.approx(PER_BATCH["sparse"])
    assert record["gpu_batches"] == batches


def test_a_host_figure_hidden_by_noise_is_left_positive(monkeypatch):
    def noisy(compute, dtype, cases, repeats, offload_dir, *timing):
        timed = fake_cases(compute, dtype, cases, repeats, offload_dir)
        # travelling timed no slower than on the device: the travelling extra reads as nothing
        return {name: timed["on the device"] if name == "cache travels" else value for name, value in timed.items()}

    monkeypatch.setattr(module, "decode_seconds_by_case", noisy)
    _, _, extras, _ = module.host_overhead("cuda", None, batches=4)
    assert extras["host_seconds_per_travelling_layer"] == 1e-9
