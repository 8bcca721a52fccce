"""Re-predicting recorded calibration runs with figures from another profile: nothing swapped gives
the recorded prediction back; a faster matmul from the other profile raises the predicted prefill;
a figure the other profile lacks is named."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.calibration import repredict  # noqa: E402
from bench.cost_model_accuracy import _prediction  # noqa: E402
from flexoff.planner.hardware import HardwareProfile, packaged_profile  # noqa: E402
from flexoff.planner.report import policy_summary  # noqa: E402
from flexoff.policy import CompressionConfig, Policy, TierFractions  # noqa: E402

GiB = 1 << 30
POLICY = Policy(16, 2, TierFractions(0.2, 0.8, 0), TierFractions(0, 1, 0), TierFractions(1, 0, 0),
                compress_weight=CompressionConfig(4, 64), compress_cache=CompressionConfig(4, 64))


def _recorded(profile: HardwareProfile) -> dict:
    hardware = profile.with_memory(gpu=16 * GiB)
    predicted = _prediction("opt-30b", POLICY, hardware, 512, 8, 32)
    measured = {key: predicted[key] * 1.1 for key in ("total_throughput", "prefill_throughput", "decode_throughput")}
    record = {"name": "a case", "model": "opt-30b", "gpu_mem": "16GiB", "cpu_mem": None, "policy": POLICY.to_dict(),
              "summary": policy_summary(POLICY), "workload": {"prompt_len": 512, "gen_len": 8, "num_prompts": 32},
              "predicted": predicted, "measured": measured}
    return {"hardware": profile.to_dict(), "records": [record, {**record, "measured": {"error": "out of memory"}}]}


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_nothing_swapped_predicts_as_recorded():
    h100 = packaged_profile("h100")
    [row] = repredict.rows(_recorded(h100), h100, list(repredict.GPU_RATES))  # the failed run has no row
    cells = _cells(row)
    assert cells[3] == cells[4] == f"{float(cells[2]) / 1.1:.2f} (+10%)"
    assert cells[5] == cells[6] == "+10% → +10%"


def test_a_faster_matmul_raises_the_predicted_prefill():
    h100 = packaged_profile("h100")
    faster = h100.to_dict()
    faster["compute"]["matmul_flop_per_s"] = [[m, 4 * f] for m, f in faster["compute"]["matmul_flop_per_s"]]
    [row] = repredict.rows(_recorded(h100), HardwareProfile.from_dict(faster), ["compute.matmul_flop_per_s"])
    prefill_before, prefill_after = (int(e.rstrip("%")) for e in _cells(row)[5].split(" → "))
    assert prefill_after < prefill_before


def test_a_figure_the_other_profile_lacks_is_named():
    h100 = packaged_profile("h100")
    with pytest.raises(ValueError, match="compute.warp_speed"):
        repredict.rows(_recorded(h100), h100, ["compute.warp_speed"])


def test_by_default_only_the_rates_the_other_profile_has_are_swapped():
    h200 = packaged_profile("h200")  # measured before the KV quantize rate was a figure of its own
    fields = repredict.present(h200, repredict.GPU_RATES)
    assert "compute.matmul_flop_per_s" in fields and "compute.gpu_kv_quant_elements_per_s" not in fields
    [row] = repredict.rows(_recorded(h200), h200, fields)
    assert _cells(row)[5] == "+10% → +10%"
