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


@pytest.mark.parametrize("model", ["opt-30b", "opt-66b"])
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
