"""scenario_state.json files written by crfm-helm itself (tests/harness/data/helm, README there says
how): flexoff runs HELM's own requests, and --max-instances picks the instances HELM's runner picks."""

import json

import pytest

import flexoff.harness.bench as bench
from flexoff.commands.main import main

from .conftest import DATA

HELM = DATA / "helm"


def helm_states(run: str) -> list[dict]:
    return json.loads((HELM / run / "scenario_state.json").read_text())["request_states"]


def helm_ids(run: str) -> list[str]:
    return [state["instance"]["id"] for state in helm_states(run)]


def run_bench(model, run: str, output_dir, *extra) -> list[dict]:
    assert main(["bench", "--scenario", "synthetic_reasoning", "--model", str(model), "--output-dir", str(output_dir),
                 "--data", str(HELM / run / "scenario_state.json"), "--no-progress", "--gpu-batch-size", "4",
                 *extra]) == 0
    return [json.loads(line) for line in (output_dir / "instances.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("run", ["synthetic_reasoning_m10", "simple_classification_m10"])
def test_helms_requests_run_as_helm_made_them(tiny_opt, tmp_path, monkeypatch, run):
    sent = []

    def recording(llm, store, items, **kwargs):
        sent.extend(items)
        return run_generation(llm, store, items, **kwargs)

    run_generation = bench.run_generation
    monkeypatch.setattr(bench, "run_generation", recording)
    rows = run_bench(tiny_opt[0], run, tmp_path / "out")
    states = helm_states(run)
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


def test_max_instances_on_all_instances_picks_what_helm_picked(tiny_opt, tmp_path):
    # HELM kept all 79 instances under -m 1000; its own -m 10 run drew 10 of them.
    rows = run_bench(tiny_opt[0], "simple_classification_all", tmp_path / "out", "--max-instances", "10")
    assert [row["id"] for row in rows] == helm_ids("simple_classification_m10")


def test_max_instances_on_helms_draw_picks_what_helm_picked(tiny_opt, tmp_path):
    # HELM's -m 10 run is a draw from 10000 instances; its -m 4 run drew the first 4 of the same draw.
    assert helm_ids("synthetic_reasoning_m4") == helm_ids("synthetic_reasoning_m10")[:4]
    rows = run_bench(tiny_opt[0], "synthetic_reasoning_m10", tmp_path / "out", "--max-instances", "4")
    assert [row["id"] for row in rows] == helm_ids("synthetic_reasoning_m4")
