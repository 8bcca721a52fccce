"""The calibration grid around a searched policy: at least six distinct neighbours, each one step
from it, each predicted to fit, with cache and activations in whole rows of a GPU batch."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from calibration.grid import MIN_NEIGHBOURS, neighbours  # noqa: E402
from flexoff.models import REGISTRY  # noqa: E402
from flexoff.planner.cost_model import CostModel, Workload  # noqa: E402
from flexoff.planner.hardware import packaged_profile  # noqa: E402
from flexoff.planner.search import search_policy  # noqa: E402

GiB = 1 << 30


@pytest.mark.parametrize("model", ["opt-30b", "opt-66b", "mixtral-8x7b", "qwen3-30b-a3b"])
def test_grid_of_a_searched_16gib_policy(model):
    hardware = packaged_profile("h100").with_memory(gpu=16 * GiB)
    workload = Workload(512, 32)
    config = REGISTRY[model]
    searched = search_policy(config, workload, hardware, compress="auto").policy
    fitting, _ = neighbours(searched, config, workload, hardware)
    policies = [n.policy for n in fitting]
    assert len(policies) >= MIN_NEIGHBOURS
    assert len(set(policies)) == len(policies) and searched not in policies
    cost = CostModel(config, workload, hardware)
    for neighbour in fitting:
        assert cost.predict(neighbour.policy).fits, neighbour.label
        rows = neighbour.policy.gpu_batch_size
        for fractions in (neighbour.policy.cache, neighbour.policy.activations):
            for share in fractions.as_tuple():
                # Policies keep fractions to four decimals.
                assert share * rows == pytest.approx(round(share * rows), abs=rows * 1e-4), neighbour.label


def test_a_policy_whose_steps_up_cannot_fit_still_has_six_neighbours():
    """A policy at the GPU's edge with its cache split between CPU and disk (as a search over a
    measured profile returns): the steps of the disk's shares and of the activations fill the grid,
    each moving one row of a GPU batch or one weight step."""
    from flexoff.policy import CompressionConfig, Policy, TierFractions

    hardware = packaged_profile("h100").with_memory(gpu=16 * GiB)
    workload = Workload(512, 32)
    config = REGISTRY["opt-30b"]
    policy = Policy(gpu_batch_size=64, num_gpu_batches=7, weights=TierFractions(0.0016, 0.9984, 0.0),
                    cache=TierFractions(0.0, 61 / 64, 3 / 64), activations=TierFractions(62 / 64, 2 / 64, 0.0),
                    compress_weight=CompressionConfig(4, 64), compress_cache=CompressionConfig(4, 64))
    assert CostModel(config, workload, hardware).predict(policy).fits
    fitting, _ = neighbours(policy, config, workload, hardware, exclude=("cpu attention",))
    assert len(fitting) >= MIN_NEIGHBOURS
    by_label = {n.label.split(",")[0]: n.policy for n in fitting}
    assert round(by_label["cache disk 4 of 64 rows"].cache.disk * 64) == 4
    assert round(by_label["cache disk 2 of 64 rows"].cache.disk * 64) == 2
    assert by_label["weights disk 5%"].weights.disk == pytest.approx(0.05)
    assert by_label["weights disk 5%"].weights.gpu == policy.weights.gpu
    moved = [p for label, p in by_label.items() if label.startswith("activations gpu 61")]
    assert moved and round(moved[0].activations.cpu * 64) == 3


def test_the_calibration_holds_mixtures_of_experts_the_runtime_admits():
    """Mixtral-8x7B and Qwen3-30B-A3B cases, searched and by hand under 16 GiB: each resolves to a
    policy the cost model says fits and the layout (the runtime's check) admits, so none is refused."""
    import torch

    from calibration.cases import CASES, resolve
    from flexoff.layout import Capacity, overflow, job_bytes

    hardware = packaged_profile("h100")
    workload = Workload(512, 32)
    moe = [spec for spec in CASES if spec.model in ("mixtral-8x7b", "qwen3-30b-a3b")]
    assert {(spec.model, spec.searched) for spec in moe} == {
        (model, searched) for model in ("mixtral-8x7b", "qwen3-30b-a3b") for searched in (True, False)}
    for spec in moe:
        case = resolve(spec, hardware, workload)
        capped = case.hardware(hardware)
        config = REGISTRY[case.model]
        assert CostModel(config, workload, capped).predict(case.policy).fits, spec.name
        needed = job_bytes(config, case.policy, torch.float16, workload.prompt_len, workload.gen_len, pinned=True)
        capacity = Capacity(*(int(capped.capacity(tier)) for tier in ("gpu", "cpu", "disk")))
        assert overflow(needed, capacity) is None, spec.name
