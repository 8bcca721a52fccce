"""A model whose checkpoint stores its matrices compressed is planned with them as stored: every
frame's weights are in the stored format, --compress decides the KV cache alone, and the cost
model prices the weights compressed."""

import json

import pytest
import torch

from flexoff.api import DEFAULT_POLICY
from flexoff.commands.main import main
from flexoff.layout import Capacity, job_bytes, overflow, weight_bytes
from flexoff.models import REGISTRY
from flexoff.planner.cost_model import Workload
from flexoff.planner.default import fit_job, plan_default
from flexoff.planner.hardware import packaged_profile
from flexoff.planner.search import DEFAULT_COMPRESSION, candidate_frames, pareto_frontier, search_policy
from flexoff.policy import CompressionConfig, Policy

STORED = CompressionConfig(4, 32)
WORKLOAD = Workload(512, 32)
SMALL_GRID = dict(gpu_batch_sizes=(4, 16, 32, 64), num_gpu_batches=(1, 2, 4, 8))
T4 = packaged_profile("t4")
CACHE = {"off": {None}, "on": {DEFAULT_COMPRESSION}, "auto": {None, DEFAULT_COMPRESSION}}


def stored(name: str):
    return REGISTRY[name].replace(stored_compression=STORED)


@pytest.mark.parametrize("compress", ["off", "auto", "on"])
def test_every_frame_reads_the_weights_as_stored_and_compress_decides_the_cache(compress):
    frames = candidate_frames(compress, stored=STORED, **SMALL_GRID)
    assert {frame.compress_weight for frame in frames} == {STORED}
    assert {frame.compress_cache for frame in frames} == CACHE[compress]
    # A model stored in floats: compress decides both, alike.
    plain = candidate_frames(compress, **SMALL_GRID)
    assert all(frame.compress_weight == frame.compress_cache for frame in plain)


@pytest.mark.parametrize("compress", ["off", "on"])
def test_the_search_and_the_frontier_plan_the_stored_format(compress):
    config = stored("opt-30b")
    result = search_policy(config, WORKLOAD, T4, compress=compress, **SMALL_GRID)
    frontier = pareto_frontier(config, WORKLOAD, T4, compress=compress, **SMALL_GRID)
    for policy in [result.policy, *(r.policy for r in frontier)]:
        assert policy.compress_weight == STORED and {policy.compress_cache} <= CACHE[compress], policy


def test_the_cost_model_prices_the_weights_compressed():
    """OPT-175B's fp16 weights (350 GB) overflow the T4 machine's host memory; stored 4-bit, its
    plan (lossless in the cache) holds them in about a third of that, and runs more than twice as
    fast as the float model's lossless plan."""
    plain, packed = REGISTRY["opt-175b"], stored("opt-175b")
    ours = search_policy(packed, WORKLOAD, T4, **SMALL_GRID)
    floats = search_policy(plain, WORKLOAD, T4, **SMALL_GRID)
    assert ours.policy.compress_cache is None and ours.policy.compress_weight == STORED
    fp16_weights = sum(weight_bytes(plain, Policy(), torch.float16).values())
    stored_weights = sum(weight_bytes(packed, ours.policy, torch.float16).values())
    assert stored_weights < fp16_weights * 0.35  # 5 bits a weight: 4 and, per group of 32, two fp16
    assert ours.throughput > 2 * floats.throughput


def test_a_planned_default_reads_the_weights_as_stored_with_a_lossless_cache():
    config, workload = stored("opt-125m"), Workload(14, 4, 5)
    needed = job_bytes(config, Policy(32, compress_weight=STORED), torch.bfloat16, 14, 4, False)
    capacity = Capacity(needed["gpu"] * 3 // 4, 1 << 34, None, "cuda")
    plan = plan_default(config, workload, capacity, torch.bfloat16, lambda: packaged_profile("h100"), DEFAULT_POLICY)
    assert plan.search is not None
    assert plan.policy.compress_weight == STORED and plan.policy.compress_cache is None
    assert overflow(job_bytes(config, plan.policy, torch.bfloat16, 14, 4, False), capacity) is None


def test_fit_job_takes_the_stored_format_and_refuses_another():
    from flexoff.errors import PolicyError

    config, roomy = stored("opt-125m"), Capacity(1 << 34, 1 << 34, None, "cuda")
    plan = fit_job(config, Workload(14, 4, 5), Policy(8), torch.float16, roomy, T4, DEFAULT_POLICY, None)
    assert plan.policy == Policy(8, compress_weight=STORED)
    plan = fit_job(config, Workload(14, 4, 5), None, torch.float16, roomy, T4, DEFAULT_POLICY, None)
    assert plan.policy == Policy(32, compress_weight=STORED) and plan.search is None
    with pytest.raises(PolicyError, match="opt-125m stores its matrices as 4-bit groups of 32; a policy cannot "
                                          "recompress them as 8-bit groups of 64"):
        fit_job(config, Workload(14, 4, 5), Policy(8, compress_weight=CompressionConfig(8, 64)), torch.float16,
                roomy, T4, DEFAULT_POLICY, None)


@pytest.mark.parametrize("compress, cache", [(None, None), ("on", {"bits": 4, "group_size": 64})])
def test_flexoff_search_plans_and_shows_the_weights_as_stored(monkeypatch, tmp_path, capsys, compress, cache):
    import flexoff.commands.search as search

    monkeypatch.setattr(search, "resolve_model_config", lambda name: stored(name))
    output = tmp_path / "policy.json"
    flags = ["--compress", compress] if compress else []
    assert main(["search", "--model", "opt-30b", "--hardware", "t4", "--output", str(output), *flags]) == 0
    policy = json.loads(output.read_text())
    assert policy["compress_weight"] == {"bits": 4, "group_size": 32} and policy["compress_cache"] == cache
    shown = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("compression"))
    assert "weights 4-bit g32 as stored" in shown and ("cache 4-bit g64" in shown) == (cache is not None)
