import numpy as np
import pytest
import torch

from flexoff.errors import ConfigError
from flexoff.profiler.machine import fit_bandwidth, profile_machine


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


class FakeClock:
    """A clock that each timed call moves on by ``step`` seconds."""

    def __init__(self, step: float = 1.0):
        self.now, self.step, self.calls = 0.0, step, 0

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.calls += 1
        self.now += self.step


def test_a_timing_stops_repeating_at_its_deadline():
    from flexoff.profiler.kernels import Deadline, best_seconds

    clock = FakeClock()
    # min_seconds alone would repeat 50 times; the deadline (3 s in) stops it after the warm-up and two
    assert best_seconds(clock.work, torch.device("cpu"), 100.0, deadline=Deadline(3.0, clock)) == 1.0
    assert clock.calls == 3
    late = FakeClock()
    late.now = 10.0  # already past: the warm-up and one timed call, which a figure needs
    best_seconds(late.work, torch.device("cpu"), 100.0, deadline=Deadline(3.0, late))
    assert late.calls == 2
    unhurried = FakeClock()
    best_seconds(unhurried.work, torch.device("cpu"), 100.0, deadline=Deadline(None, unhurried))
    assert unhurried.calls == 51  # no deadline: as before


def test_the_budget_shares_what_is_left_by_weight_and_reports_progress():
    from flexoff.profiler.kernels import Budget

    clock, heard = FakeClock(), []
    budget = Budget(10.0, {"copies": 1.0, "disk": 1.0, "host time": 2.0},
                    lambda fraction, step: heard.append((fraction, step)), clock)
    assert budget.start("copies").at == pytest.approx(2.5)
    clock.now = 5.0  # the copies overran their share: the rest share the 5 s left
    assert budget.start("disk").at == pytest.approx(5.0 + 5.0 / 3)
    clock.now = 11.0  # past the end: what is left runs once, at once
    host = budget.start("host time")
    assert host.at == pytest.approx(11.0) and host.passed()
    budget.finish()
    assert heard == [(0.0, "copies"), (0.25, "disk"), (0.5, "host time"), (1.0, None)]
    assert Budget(None, {"copies": 1.0}).start("copies").at is None  # a full profile has no deadline


class _FakeEngine:
    runs: list = []

    def __init__(self, config, weights, policy, device, dtype, offload_dir=None):
        self.layers = config.num_layers

    def generate_block(self, sequences):
        steps = sequences[0].params.max_new_tokens - 1
        _FakeEngine.runs.append(steps)
        from types import SimpleNamespace

        return SimpleNamespace(decode_time=steps * 1e-3 * self.layers)

    def close(self):
        pass


@pytest.mark.parametrize("passed, timed_rounds", [(False, 3), (True, 1)])
def test_the_host_probe_starts_no_round_past_its_deadline(monkeypatch, passed, timed_rounds):
    from types import SimpleNamespace

    from flexoff.profiler import host_overhead
    from flexoff.runtime import engine

    monkeypatch.setattr(engine, "Engine", _FakeEngine)
    _FakeEngine.runs = []
    cases = {"a": (None, host_overhead.OPT_FIELDS, 1), "b": (None, host_overhead.OPT_FIELDS, 1)}
    deadline = SimpleNamespace(passed=lambda: passed)
    timed = host_overhead.decode_seconds_by_case(torch.device("cpu"), torch.float32, cases, repeats=3,
                                                 deadline=deadline, steps=5, depths=(1, 3))
    engines = len(cases) * 2
    assert _FakeEngine.runs == [1] * engines + [5] * engines * timed_rounds  # a one-step warm-up, then rounds
    assert timed["a"][0] == pytest.approx(1e-3) and set(timed["a"][1]) == {1, 3}


def test_a_quick_profile_reports_its_progress_and_measures_what_the_planner_reads(monkeypatch, tmp_path):
    from dataclasses import fields

    from flexoff.profiler import machine as profiler
    from flexoff.planner.hardware import HardwareProfile

    monkeypatch.setattr(profiler, "QUICK", profiler.ProfileSizes(
        (1 << 20, 4 << 20), 8 << 20, (1, 16), 128, 256, 1, 1 << 16, 0.0, 1 << 20, budget_seconds=5.0))
    monkeypatch.setattr(profiler, "QUICK_HOST_PROBE", {"steps": 2, "depths": (1, 2)})
    heard = []
    profile = profiler.profile_machine(quick=True, disk_dir=str(tmp_path), device="cpu",
                                       progress=lambda fraction, step: heard.append((fraction, step)))
    fractions = [fraction for fraction, _ in heard]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and heard[-1] == (1.0, None)
    assert [step for _, step in heard[:-1]] == list(profiler._step_weights(False, 1))
    assert profile.measurements["host_overhead"]["depths"] == [1, 2]
    # every figure the cost model reads is measured, none left at its "not measured" default
    unmeasured = {"cpu_to_all_gpus_bandwidth", "gpu_to_cpu_cache_bandwidth", "cpu_to_disk_cache_bandwidth",
                  "cpu_attention_share_under_copy", "cpu_attention_seconds_per_call"}
    for field in fields(HardwareProfile):
        value = getattr(profile, field.name)
        if field.name not in unmeasured and isinstance(value, float):
            assert value > 0, field.name
    assert profile.disk_to_cpu_cached_bandwidth and profile.matmul_flops


def test_a_disk_that_fills_while_the_quick_profile_measures_it_is_one_error(monkeypatch, tmp_path):
    import errno

    from flexoff.profiler import machine as profiler

    def full(**_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "profile_machine", full)
    with pytest.raises(ConfigError, match=f"^cannot measure the disk under {tmp_path} \\(No space left on device\\)"):
        profiler.saved_or_measured_profile(torch.device("cpu"), str(tmp_path), lambda message: None)
    assert not (tmp_path / "cache" / "flexoff" / "hardware.json").exists()


@pytest.mark.parametrize("quick", [True, False])
def test_a_gpu_profile_quick_or_full_times_the_routed_experts(monkeypatch, quick):
    """Without the routed experts' rates the planner prices them at the dense curve, which put a
    quick profile's Qwen3-30B-A3B prefill at 1.6x what it ran at: a quick GPU profile measures them too."""
    from flexoff.planner.sparse_rate import SparseRate
    from flexoff.profiler import machine as profiler

    rate = SparseRate((2048, 768, 128, 8), ((8192.0, 3e14),))
    asked = []

    def measured(device, dtype, seconds, log=lambda message: None):
        asked.append((device.type, dtype))
        return (rate,), {"2048x768x128x8": {"tokens": [8192.0], "flop_per_s": [3e14]}}

    monkeypatch.setattr(profiler, "measure_sparse_rates", measured)
    sizes = profiler.QUICK_GPU if quick else profiler.FULL

    def run(use_cuda: bool):
        budget = profiler.Budget(None, profiler._step_weights(use_cuda, 1))
        return profiler._Profiling(quick, use_cuda, sizes, "/tmp", 1, budget, lambda message: None)

    assert profiler._routed_experts(run(True)) == {"sparse_mlp_flops": (rate,)}
    assert asked == [("cuda", torch.bfloat16)]
    assert profiler._routed_experts(run(False)) == {"sparse_mlp_flops": ()}
