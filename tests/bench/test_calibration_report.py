"""The calibration report judges a GPU prediction by what the allocator reserved where a run
measured it, and by the allocated peak for runs recorded before."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.calibration import report  # noqa: E402

GiB = 1 << 30
PREDICTED = {"total_throughput": 10.0, "prefill_throughput": 100.0, "decode_throughput": 12.0,
             "gpu": 20 * GiB, "cpu": 50 * GiB, "disk": 0, "block_latency": 3.0}
MEASURED = {"total_throughput": 10.0, "prefill_throughput": 100.0, "decode_throughput": 12.0,
            "gpu": 15 * GiB, "cpu": 50 * GiB, "disk": 0, "seconds": 30}


def _record(measured):
    return {"name": "a case", "predicted": PREDICTED, "measured": measured, "summary": "16x1"}


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_the_reserved_peak_is_the_one_judged():
    cells = _cells(report.case_row(_record({**MEASURED, "gpu_reserved": 21 * GiB})))
    header = _cells(report.CASE_HEADER)
    assert len(cells) == len(header)
    at = header.index("GPU GiB pred")
    assert cells[at:at + 4] == ["20.0", "21.0", "+5%", "15.0"]
    assert "GPU memory within ±10%: 1/1" in report.summary([_record({**MEASURED, "gpu_reserved": 21 * GiB})])


def test_without_a_reserved_peak_the_allocated_one_is_judged():
    cells = _cells(report.case_row(_record(MEASURED)))
    at = _cells(report.CASE_HEADER).index("GPU GiB pred")
    assert cells[at:at + 4] == ["20.0", "15.0", "-25%", "15.0"]
    assert "GPU memory within ±10%: 0/1" in report.summary([_record(MEASURED)])


def test_a_failed_run_fills_every_column():
    row = report.case_row(_record({"error": "out of memory"}))
    assert len(_cells(row)) == len(_cells(report.CASE_HEADER))


def test_runs_held_out_of_the_calibration_are_summed_up_apart():
    tuned = {**_record({**MEASURED, "total_throughput": 11.0}), "searched": True, "held_out": False}
    held = {**_record({**MEASURED, "total_throughput": 7.0}), "searched": True, "held_out": True}
    lines = report.summaries([tuned, held])
    assert [line.split(":")[0] for line in lines] == ["all", "searched", "calibration", "held out"]
    assert "throughput within ±15%: 1/2 (worst -30%)" in lines[0]
    assert "throughput within ±15%: 1/1 (worst +10%)" in lines[2]
    assert "throughput within ±15%: 0/1 (worst -30%)" in lines[3]
    # Records of calls before cases were held out have no such field: two lines, as before.
    assert len(report.summaries([_record(MEASURED) | {"searched": True}])) == 2


def test_the_families_set_covers_five_models_under_both_caps_with_one_held_out():
    from bench.calibration.cases import CASES, SETS

    families = SETS["families"]
    assert [(s.model, s.gpu_mem) for s in families] == [
        (model, cap) for model in ("llama-3-8b", "llama-3-70b", "qwen3-32b", "mixtral-8x7b", "qwen3-30b-a3b")
        for cap in ("16GiB", "24GiB")]
    assert all(s.searched and s.compress == "auto" for s in families)
    assert {s.model for s in families if s.held_out} == {"qwen3-32b"}
    assert len({s.name for s in CASES}) == len(CASES)  # a name selects one case
