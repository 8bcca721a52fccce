"""The calibration grid around a searched policy: at least six distinct neighbours, each one step
from it, each predicted to fit, with cache and activations in whole rows of a GPU batch."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from calibration.grid import MIN_NEIGHBOURS, neighbours  # noqa: E402
from flexoff.models.config import REGISTRY  # noqa: E402
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
