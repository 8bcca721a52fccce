"""HELM's scenario_state.json as bench data, run with HELM's own prompts and settings, and
--max-instances sampled as HELM's runner samples."""

import json
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from flexoff.commands.main import main
from flexoff.harness.helm_state import helm_sample
from flexoff.harness.scenarios import Instance, build_prompt, choose_examples, get_scenario, load_instances


def helm_reference(instances, n):
    """What HELM's runner keeps: every eval instance, or a draw of n from the global numpy
    generator seeded with 0."""
    evaluated = [i for i in instances if i.split in ("valid", "test")]
    if len(evaluated) <= n:
        return evaluated
    np.random.seed(0)
    return list(np.random.choice(evaluated, n, replace=False))


@pytest.mark.parametrize("total, n", [(10, 3), (1000, 6), (57, 57), (57, 100), (240, 31)])
def test_max_instances_picks_what_helm_picks(total, n):
    splits = ["train", "test", "valid", "test"]
    instances = [Instance(f"id{i}", f"text {i}", ("r",), splits[i % 4]) for i in range(total)]
    assert helm_sample(instances, n) == helm_reference(instances, n)
    # A larger draw begins with the smaller one: raising --max-instances reuses what was run.
    if n + 5 < sum(i.split != "train" for i in instances):
        assert helm_sample(instances, n + 5)[:n] == helm_sample(instances, n)


def scenario_state(instances, prompts, max_tokens=3):
    """A scenario state in HELM's layout (``asdict`` of its ScenarioState, None fields left out)."""
    def state(instance, prompt, trial):
        return {
            "instance": {"input": {"text": instance.input},
                         "references": [{"output": {"text": "decoy"}, "tags": []},
                                        {"output": {"text": instance.references[0]}, "tags": ["correct"]}],
                         "split": instance.split, "id": instance.id},
            "train_trial_index": trial,
            "request": {"model": "tiny/opt", "embedding": False, "prompt": prompt, "temperature": 0.0,
                        "num_completions": 1, "top_k_per_token": 1, "max_tokens": max_tokens,
                        "stop_sequences": ["\n"], "echo_prompt": False, "top_p": 1},
            "num_train_instances": 2, "prompt_truncated": False,
        }
    return {
        "adapter_spec": {"method": "generation", "global_prefix": "", "instructions": "Please solve the following "
                         "problem.\n", "input_prefix": "", "input_suffix": "\n", "output_prefix": "Target: ",
                         "output_suffix": "\n", "instance_prefix": "\n", "max_train_instances": 2,
                         "max_eval_instances": 1000, "num_outputs": 1, "num_train_trials": 1, "model": "tiny/opt",
                         "temperature": 0.0, "max_tokens": max_tokens, "stop_sequences": ["\n"]},
        "request_states": [state(i, p, trial) for trial in (0, 1) for i, p in zip(instances, prompts)],
    }


def test_a_scenario_state_runs_with_helms_prompts_and_picks(tiny_opt, tmp_path):
    scenario = get_scenario("synthetic_reasoning")
    generated = load_instances(scenario, None, seed=0)
    train = [i for i in generated if i.split == "train"]
    evaluated = [i for i in generated if i.split == "test"][:20]
    # Two examples, where flexoff's own prompts carry five: the run must use these as they are.
    examples = choose_examples(train, 2, seed=3)
    prompts = [build_prompt(scenario, examples, i) for i in evaluated]
    state_file = tmp_path / "scenario_state.json"
    state_file.write_text(json.dumps(scenario_state(evaluated, prompts)))
    output_dir = tmp_path / "out"
    assert main(["bench", "--scenario", "synthetic_reasoning", "--model", str(tiny_opt[0]), "--data", str(state_file),
                 "--max-instances", "5", "--output-dir", str(output_dir), "--no-progress",
                 "--gpu-batch-size", "4"]) == 0
    rows = [json.loads(line) for line in (output_dir / "instances.jsonl").read_text().splitlines()]
    picked = helm_reference(evaluated, 5)
    assert [r["id"] for r in rows] == [i.id for i in picked]
    tokenizer = AutoTokenizer.from_pretrained(tiny_opt[0])
    by_id = dict(zip((i.id for i in evaluated), prompts))
    for row, instance in zip(rows, picked):
        assert row["references"] == list(instance.references)  # the reference tagged correct, not the decoy
        assert row["num_in_context"] == 2
        assert row["prompt_tokens"] == len(tokenizer.encode(by_id[row["id"]]))
    records = [json.loads(line) for line in (output_dir / "results.jsonl").read_text().splitlines()]
    generated = [r for r in records if r.get("kind") == "generate"]
    assert sorted(r["prompt"] for r in generated) == sorted(by_id[i.id] for i in picked)
    # HELM's max_tokens (3) ends them, not the scenario's 50
    assert {(r["generated_tokens"], r["finish_reason"]) for r in generated} == {(3, "length")}
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["instances"] == 5


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.pop("adapter_spec"), r"scenario_state.json: missing field 'adapter_spec'"),
    (lambda s: s["request_states"][0]["instance"]["references"][1].update(tags=[]),
     r"request_states\[0\].instance: no reference is tagged 'correct'"),
    (lambda s: s["request_states"][1]["instance"].update(split="dev"), r"request_states\[1\].instance: field 'split'"),
    (lambda s: s["request_states"][0]["request"].pop("prompt"), r"request_states\[0\].request: missing field 'prompt'"),
    (lambda s: s["adapter_spec"].update(max_tokens="8"), r"adapter_spec: field 'max_tokens' must be int"),
])
def test_a_bad_scenario_state_is_refused_in_one_line(tiny_opt, tmp_path, capsys, mutate, message):
    instances = [Instance(f"i{n}", f"Rules: X | Result: a{n}", ("X",)) for n in range(3)]
    state = scenario_state(instances, [i.input for i in instances])
    mutate(state)
    state_file = tmp_path / "scenario_state.json"
    state_file.write_text(json.dumps(state))
    assert main(["bench", "--scenario", "synthetic_reasoning", "--model", str(tiny_opt[0]), "--data", str(state_file),
                 "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.search(message, err), err
