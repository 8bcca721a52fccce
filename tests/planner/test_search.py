import dataclasses
import itertools
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexoff.errors import PolicyError
from flexoff.models import REGISTRY
from flexoff.planner.cost_model import CostModel, Placement, PolicyFrame, Workload
from flexoff.planner.hardware import packaged_profile
from flexoff.planner.search import (
    FrameProblem, _searcher, candidate_frames, pareto_frontier, round_fractions, row_splits, search_policy,
)
from flexoff.policy import TIERS, CompressionConfig

WORKLOAD = Workload(512, 32)
FOUR_BIT = CompressionConfig(4, 64)
# A coarse grid keeps the monotonicity searches quick; the search logic is the same.
SMALL_GRID = dict(gpu_batch_sizes=(4, 16, 32, 48, 64), num_gpu_batches=(1, 2, 4, 8))


def _grid(step: float) -> Placement:
    """Every placement whose fractions are multiples of ``step``, as arrays."""
    ticks = np.round(np.arange(0, 1 + 1e-9, step), 9)
    triples = [(a, b, 1 - a - b) for a in ticks for b in ticks if a + b <= 1 + 1e-9]
    rows = [sum(combo, ()) for combo in itertools.product(triples, repeat=3)]
    return Placement(*np.clip(np.array(rows), 0, 1).T)


@pytest.mark.parametrize("model_name, frame", [
    ("opt-30b", PolicyFrame(32, 3, cpu_attention=True)),
    ("opt-30b", PolicyFrame(16, 4, FOUR_BIT, FOUR_BIT)),
    ("opt-175b", PolicyFrame(16, 4, FOUR_BIT, FOUR_BIT)),
    ("opt-175b", PolicyFrame(4, 8, cpu_attention=True)),
])
def test_lp_answer_is_feasible_and_no_grid_placement_beats_it(model_name, frame):
    model = CostModel(REGISTRY[model_name], WORKLOAD, packaged_profile("t4"))
    problem = FrameProblem(model, frame)
    fractions, latency = problem.solve(margin=0.0)
    for group in range(3):
        assert sum(fractions[3 * group: 3 * group + 3]) == pytest.approx(1, abs=1e-6)
    prediction = model.predict(frame.with_placement(round_fractions(fractions, 9)))
    assert prediction.block_latency == pytest.approx(latency, rel=1e-6)
    assert all(prediction.peak_memory[t] <= prediction.capacity[t] * (1 + 1e-6) for t in TIERS)

    grid = _grid(0.125)
    memory = model.memory_terms(frame, grid)
    fits = np.ones(len(grid.wg), dtype=bool)
    for (tier, _phase), used in memory.items():
        fits &= np.asarray(used) <= model.hardware.capacity(tier)
    assert fits.any()
    terms = model.phase_terms(frame, grid)
    seconds = {phase: model.phase_seconds(*terms[phase], frame.overlap) for phase in terms}
    grid_latency = model.block_seconds(seconds["prefill"], seconds["decode"])
    assert grid_latency[fits].min() >= latency * (1 - 1e-6)  # the LP solver's tolerance is about 1e-7


def test_latency_bounds_used_for_pruning_never_exceed_the_lp_optimum():
    model = CostModel(REGISTRY["opt-175b"], WORKLOAD, packaged_profile("t4"))
    frames = candidate_frames("auto", "auto", (1, 8, 32, 96), (1, 3, 8, 24))
    checked = 0
    for frame in frames:
        problem = FrameProblem(model, frame)
        solution = problem.solve() if problem.may_fit() else None
        if solution is not None:
            assert problem.latency_lower_bound() <= solution[1] * (1 + 1e-6)  # the LP solver's tolerance
            checked += 1
    assert checked > 10


def test_searched_policy_fits_and_is_the_best_solved_frame():
    hardware = packaged_profile("t4")
    result = search_policy(REGISTRY["opt-30b"], WORKLOAD, hardware, compress="off", **SMALL_GRID)
    assert result.prediction.fits
    model = CostModel(REGISTRY["opt-30b"], WORKLOAD, hardware)
    best_lp = 0.0
    for frame in candidate_frames("off", "auto", **SMALL_GRID):
        problem = FrameProblem(model, frame)
        solution = problem.solve()
        if solution is None:
            continue
        best_lp = max(best_lp, frame.block_size * WORKLOAD.gen_len / solution[1])
        in_rows = problem.solve_in_rows(*solution)
        if in_rows is not None:
            assert frame.block_size * WORKLOAD.gen_len / in_rows[1] <= result.throughput * (1 + 1e-3)
    # Whole rows cost little against the LP's fractions of a sequence, and never gain.
    assert 0.97 * best_lp <= result.throughput <= best_lp * (1 + 1e-6)


def test_row_splits_round_the_gpu_and_disk_rows_both_ways():
    # 1.27 rows on the GPU, 0.07 on disk
    assert row_splits((0.159, 0.832, 0.009), 8) == [(0.125, 0.75, 0.125), (0.125, 0.875, 0.0), (0.25, 0.625, 0.125),
                                                    (0.25, 0.75, 0.0)]
    assert row_splits((0.25, 0.75, 0.0), 8) == [(0.25, 0.75, 0.0)]  # whole rows already
    assert row_splits((0.5, 0.0, 0.5), 1) == [(0.0, 0.0, 1.0), (0.0, 1.0, 0.0), (1.0, 0.0, 0.0)]


@pytest.mark.parametrize("model_name, profile", [("opt-66b", "h100"), ("opt-30b", "t4"), ("opt-175b", "h100")])
def test_searched_cache_and_activations_split_whole_sequences(model_name, profile):
    """The runtime splits a GPU batch's cache and activations by sequences, so the policy must too:
    otherwise its predicted memory is not what the run takes."""
    result = search_policy(REGISTRY[model_name], WORKLOAD, packaged_profile(profile), compress="auto")
    policy = result.policy
    for triple in (policy.cache, policy.activations):
        rows = [policy.gpu_batch_size * share for share in triple.as_tuple()]
        assert rows == pytest.approx([round(r) for r in rows], abs=policy.gpu_batch_size * 1e-4)


def test_whole_rows_do_not_depend_on_which_equally_fast_vertex_the_solver_returns():
    """OPT-30B 4-bit on the T4 machine is bound by dequantization: its cache may split 14 rows to 6
    or 15 to 5 between RAM and disk at the same latency, and PuLP 3 and PuLP 4 return one or the other."""
    model = CostModel(REGISTRY["opt-30b"], WORKLOAD, packaged_profile("t4"))
    problem = FrameProblem(model, PolicyFrame(20, 40, FOUR_BIT, FOUR_BIT, False, True))
    fractions, latency = problem.solve()
    vertices = [problem.solve(fixed=dict(enumerate(cache, 3))) for cache in ((0.0, 0.7, 0.3), (0.0, 0.75, 0.25))]
    assert all(v[1] == pytest.approx(latency, rel=1e-9) for v in vertices)  # equally fast
    in_rows = [problem.solve_in_rows(v[0], latency) for v in [(fractions, latency), *vertices]]
    assert in_rows[0] == in_rows[1] == in_rows[2]


@pytest.mark.parametrize("cpu_attention", ["off", "on"])
@pytest.mark.parametrize("charge", [0.0, 0.02, 0.05])
def test_a_placement_in_whole_rows_is_priced_as_its_prediction(charge, cpu_attention):
    """Terms that are not affine in the cache's split (the host's charge for disk rows, a step; with
    CPU attention, the host's share of attention, a product) are read at whole-tier placements in
    proportion; once rows are fixed, the search's latency must be the prediction's (at 0.02 s a
    layer and batch, OPT-30B's 16x16 frame was priced 96 s for a 127 s prediction; with CPU
    attention and no charge, 42.83 s for 43.35)."""
    # A host small enough that some candidates keep a share of each batch's cache on disk (without
    # CPU attention, where disk rows' reads are dear, only a smaller one does).
    host_gib = 40 if cpu_attention == "on" else 30
    hardware = dataclasses.replace(packaged_profile("h100").with_memory(16 << 30, host_gib << 30),
                                   host_seconds_per_disk_rows_layer=charge)
    searcher = _searcher(REGISTRY["opt-30b"], Workload(512, 8, 480), hardware, "auto", cpu_attention, (16, 32), (8, 16),
                         True)
    split_rows = 0
    for cand in searcher.candidates:
        whole_rows = searcher.realise(cand)
        if whole_rows is None:
            continue
        policy, prediction = searcher.finish(cand)
        assert prediction.block_latency == pytest.approx(whole_rows[1], rel=2e-4), policy
        split_rows += 0 < policy.cache.disk < 1
    assert split_rows >= 1


@pytest.mark.parametrize("model_name, cap", [("qwen3-30b-a3b", 16), ("opt-30b", 40), ("mixtral-8x7b", 24)])
def test_without_cpu_attention_no_batch_splits_its_cache_between_gpu_and_elsewhere(model_name, cap):
    """Such a batch would attend twice a layer (its GPU rows in place, the others in the workspace):
    the cache is realised with all of a batch's rows on one side of the GPU (Qwen3-30B-A3B's LP
    answer at 16 GiB keeps 3% of them on the GPU)."""
    hardware = packaged_profile("h100").with_memory(cap << 30, None)
    for compress in ("off", "auto"):
        policy = search_policy(REGISTRY[model_name], WORKLOAD, hardware, compress=compress,
                               cpu_attention="off").policy
        assert policy.cache.gpu in (0.0, 1.0), (compress, policy.cache)


_FIELDS = ["gpu_memory", "cpu_memory", "disk_memory", "cpu_to_gpu_bandwidth", "gpu_to_cpu_bandwidth",
           "disk_to_cpu_bandwidth", "cpu_to_disk_bandwidth", "cpu_attention_flops", "gpu_dequant_throughput"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(_FIELDS), factor=st.floats(1.05, 4.0), model_name=st.sampled_from(["opt-30b", "opt-175b"]))
def test_more_memory_or_bandwidth_never_predicts_lower_throughput(field, factor, model_name):
    base = packaged_profile("t4")
    better = dataclasses.replace(base, **{field: type(getattr(base, field))(getattr(base, field) * factor)})
    config = REGISTRY[model_name]
    before = search_policy(config, WORKLOAD, base, compress="auto", **SMALL_GRID).throughput
    after = search_policy(config, WORKLOAD, better, compress="auto", **SMALL_GRID).throughput
    assert after >= before * (1 - 2e-4)  # ties within 1e-4 go to the lower latency


def test_opt_175b_search_finishes_within_ten_seconds():
    started = time.perf_counter()
    result = search_policy(REGISTRY["opt-175b"], WORKLOAD, packaged_profile("t4"), compress="auto")
    assert time.perf_counter() - started < 10
    assert result.prediction.fits


def test_max_latency_trades_throughput_for_latency():
    hardware = packaged_profile("t4")
    config = REGISTRY["opt-30b"]
    free = search_policy(config, WORKLOAD, hardware, compress="auto")
    bounded = search_policy(config, WORKLOAD, hardware, compress="auto", max_latency=free.latency / 2)
    assert bounded.latency <= free.latency / 2
    assert bounded.throughput <= free.throughput


def test_infeasible_latency_reports_the_lowest_possible_one():
    hardware = packaged_profile("t4")
    config = REGISTRY["opt-175b"]
    with pytest.raises(PolicyError, match=r"lowest block latency possible is ([0-9.]+) s") as error:
        search_policy(config, WORKLOAD, hardware, compress="auto", max_latency=1.0)
    lowest = float(error.value.args[0].split("possible is ")[1].split(" s")[0])
    # that latency is reachable, and nothing faster is
    assert search_policy(config, WORKLOAD, hardware, compress="auto", max_latency=lowest * 1.001).latency <= lowest * 1.001
    with pytest.raises(PolicyError):
        search_policy(config, WORKLOAD, hardware, compress="auto", max_latency=lowest * 0.99)


def test_model_that_cannot_fit_even_offloaded_says_how_much_it_needs():
    small = packaged_profile("t4").with_memory(cpu=10 * 10**9, disk=100 * 10**9)
    with pytest.raises(PolicyError, match=r"opt-175b cannot fit .* needs at least [0-9.]+ GiB .*offer"):
        search_policy(REGISTRY["opt-175b"], WORKLOAD, small, compress="auto")
    tiny_gpu = packaged_profile("t4").with_memory(gpu=2 * 10**9)
    with pytest.raises(PolicyError, match=r"GPU needs at least [0-9.]+ GiB"):
        search_policy(REGISTRY["opt-175b"], WORKLOAD, tiny_gpu, compress="auto")


def test_pareto_frontier_is_non_dominated_and_ends_at_the_best_throughput():
    hardware = packaged_profile("t4")
    config = REGISTRY["opt-30b"]
    frontier = pareto_frontier(config, WORKLOAD, hardware, compress="off", **SMALL_GRID)
    latencies = [r.latency for r in frontier]
    throughputs = [r.throughput for r in frontier]
    assert latencies == sorted(latencies)
    assert throughputs == sorted(throughputs)
    best = search_policy(config, WORKLOAD, hardware, compress="off", **SMALL_GRID)
    assert throughputs[-1] == pytest.approx(best.throughput, rel=1e-3)
    assert all(r.prediction.fits for r in frontier)


def test_llama_with_gqa_is_searchable():
    result = search_policy(REGISTRY["llama-2-70b"], Workload(512, 32, num_prompts=100), packaged_profile("h100"),
                           compress="auto")
    assert result.prediction.fits
    assert result.policy.block_size <= 100 + result.policy.gpu_batch_size


def test_python_planning_is_lossless_unless_asked_as_the_cli_is():
    """OPT-175B on the T4 machine runs four times faster 4-bit; only compress="auto" or "on" may say so."""
    config, hardware = REGISTRY["opt-175b"], packaged_profile("t4")
    searched = search_policy(config, WORKLOAD, hardware).policy
    frontier = [r.policy for r in pareto_frontier(config, WORKLOAD, hardware, **SMALL_GRID)]
    for policy in [searched, *frontier]:
        assert policy.compress_weight is None and policy.compress_cache is None, policy
    assert search_policy(config, WORKLOAD, hardware, compress="auto").policy.compress_weight is not None


def test_bad_choice_is_a_user_error():
    with pytest.raises(PolicyError, match="compress must be one of"):
        search_policy(REGISTRY["opt-30b"], WORKLOAD, packaged_profile("t4"), compress="maybe")
