"""scenario_state.json files written by crfm-helm itself (tests/harness/data/helm, README there says
how): flexoff runs HELM's own requests, and --max-instances picks the instances HELM's runner picks."""

import json

import pytest

import flexoff.harness.bench as bench
from flexoff.commands.main import main
from flexoff.job import Job

from .conftest import DATA

HELM = DATA / "helm"


def helm_states(run: str) -> list[dict]:
    return json.loads((HELM / run / "scenario_state.json").read_text())["request_states"]


def helm_ids(run: str) -> list[str]:
    return [state["instance"]["id"] for state in helm_states(run)]


def run_bench(model, run: str | None, output_dir, *extra) -> list[dict]:
    data = ["--data", str(HELM / run / "scenario_state.json")] if run else []
    assert main(["bench", "--scenario", "synthetic_reasoning", "--model", str(model), "--output-dir", str(output_dir),
                 *data, "--no-progress", "--gpu-batch-size", "4", *extra]) == 0
    return [json.loads(line) for line in (output_dir / "instances.jsonl").read_text().splitlines()]


@pytest.fixture
def sent(monkeypatch):
    """The generation requests bench hands the model, in order."""
    items = []
    run_generation = bench.run_generation

    def recording(llm, store, generation_items, **kwargs):
        items.extend(generation_items)
        return run_generation(llm, store, generation_items, **kwargs)

    monkeypatch.setattr(bench, "run_generation", recording)
    return items


def assert_helms_requests(rows, sent, states):
    assert [row["id"] for row in rows] == [s["instance"]["id"] for s in states]
    assert len(sent) == len(states)
    for item, state in zip(sent, states):
        request = state["request"]
        assert item.prompt == request["prompt"]
        assert item.params.max_new_tokens == request["max_tokens"]
        assert list(item.params.stop) == request["stop_sequences"]
        assert item.params.temperature == request["temperature"]
    for row, state in zip(rows, states):
        correct = [r["output"]["text"] for r in state["instance"]["references"] if "correct" in r["tags"]]
        assert row["references"] == correct  # simple_classification also lists the wrong class
        assert row["num_in_context"] == state["num_train_instances"]


@pytest.mark.parametrize("run", ["synthetic_reasoning_m10", "simple_classification_m10"])
def test_helms_requests_run_as_helm_made_them(tiny_opt, tmp_path, sent, run):
    rows = run_bench(tiny_opt[0], run, tmp_path / "out")
    assert_helms_requests(rows, sent, helm_states(run))


def test_flexoffs_own_synthetic_reasoning_makes_helms_requests(tiny_opt, tmp_path, sent):
    # No --data: flexoff generates the scenario, draws 10 and builds the prompts, in-context examples included.
    rows = run_bench(tiny_opt[0], None, tmp_path / "out", "--max-instances", "10")
    assert_helms_requests(rows, sent, helm_states("synthetic_reasoning_m10"))


def test_max_instances_on_all_instances_picks_what_helm_picked(tiny_opt, tmp_path):
    # HELM kept all 79 instances under -m 1000; its own -m 10 run drew 10 of them.
    rows = run_bench(tiny_opt[0], "simple_classification_all", tmp_path / "out", "--max-instances", "10")
    assert [row["id"] for row in rows] == helm_ids("simple_classification_m10")


def test_max_instances_on_helms_draw_picks_what_helm_picked(tiny_opt, tmp_path):
    # HELM's -m 10 run is a draw from 10000 instances; its -m 4 run drew the first 4 of the same draw.
    assert helm_ids("synthetic_reasoning_m4") == helm_ids("synthetic_reasoning_m10")[:4]
    rows = run_bench(tiny_opt[0], "synthetic_reasoning_m10", tmp_path / "out", "--max-instances", "4")
    assert [row["id"] for row in rows] == helm_ids("synthetic_reasoning_m4")


def test_without_max_instances_synthetic_reasoning_evaluates_helms_draw_of_1000(tmp_path):
    from flexoff.commands.llm import job_deployment

    run = bench.open_bench(Job(), job_deployment(Job()), "synthetic_reasoning", None, tmp_path / "out")
    try:
        ids = [instance.id for instance in run.evaluated]
    finally:
        run.close()
    assert len(ids) == len(set(ids)) == 1000
    assert ids[:10] == helm_ids("synthetic_reasoning_m10")  # HELM's -m 1000 draw begins with its -m 10 draw
