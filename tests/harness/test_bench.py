"""``flexoff bench`` end to end: every shipped scenario on the tiny checkpoint."""

import json
import math

import pytest
import torch

from flexoff.commands.main import main
from flexoff.harness.metrics import best_score
from flexoff.harness.scenarios import build_prompt, choose_examples, get_scenario, load_instances

from .conftest import DATA

CASES = {
    "wikifact": ("wikifact.jsonl", 5),
    "mmlu": ("abstract_algebra_test.jsonl", 4),
    "synthetic_reasoning": (None, 6),
    "synthetic_reasoning_natural": ("synthetic_reasoning_natural.jsonl", 4),
    "xsum": ("xsum.jsonl", 3),
}


def bench_args(model, name, output_dir, *extra):
    data, _ = CASES[name]
    args = ["bench", "--scenario", name, "--model", str(model), "--output-dir", str(output_dir), "--no-progress",
            "--gpu-batch-size", "4", *extra]
    return args + (["--data", str(DATA / data)] if data else ["--max-instances", "6"])


def read_outputs(output_dir):
    summary = json.loads((output_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (output_dir / "instances.jsonl").read_text().splitlines()]
    return summary, rows


@pytest.mark.parametrize("name", list(CASES))
def test_scenario_runs_end_to_end(tiny_opt, tmp_path, capsys, name):
    scenario = get_scenario(name)
    output_dir = tmp_path / name
    assert main(bench_args(tiny_opt[0], name, output_dir)) == 0
    table = capsys.readouterr().out
    summary, rows = read_outputs(output_dir)
    assert summary["instances"] == len(rows) == CASES[name][1]
    for row in rows:
        assert len(row["predictions"]) == scenario.num_outputs
        for metric in scenario.metrics:
            assert row[metric] == best_score(metric, row["references"], row["predictions"])
        assert row["ref_logprob"] < 0 and row["ref_tokens"] >= 1
    for metric in scenario.metrics:
        assert summary["metrics"][metric] == pytest.approx(sum(r[metric] for r in rows) / len(rows))
        assert metric in table
    generation = summary["generation"]
    assert generation["num_sequences"] == len(rows) * scenario.num_outputs
    assert 0 < generation["efficiency"] <= 1 and "efficiency" in table and "wall time" in table


def test_reference_logprob_matches_transformers(tiny_opt, tmp_path, capsys):
    directory, model, tok = tiny_opt
    assert main(bench_args(directory, "mmlu", tmp_path / "mmlu")) == 0
    _, rows = read_outputs(tmp_path / "mmlu")
    scenario = get_scenario("mmlu")
    instances = load_instances(scenario, DATA / CASES["mmlu"][0])
    examples = choose_examples([i for i in instances if i.split == "train"], scenario.num_in_context, 0)
    for instance, row in zip([i for i in instances if i.split == "test"], rows):
        prompt = tok(build_prompt(scenario, examples, instance, "abstract algebra"))["input_ids"]
        continuation = tok(" " + instance.references[0])["input_ids"][1:]  # without the BOS
        with torch.no_grad():
            logits = model(torch.tensor([prompt + continuation])).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        expected = sum(float(logprobs[len(prompt) - 1 + j, token]) for j, token in enumerate(continuation))
        assert row["ref_logprob"] == pytest.approx(expected, abs=1e-4)


def test_rerun_reuses_results_and_more_instances_add_to_them(tiny_opt, tmp_path, capsys):
    output_dir = tmp_path / "sr"
    args = bench_args(tiny_opt[0], "synthetic_reasoning", output_dir)
    assert main(args) == 0
    first, _ = read_outputs(output_dir)
    capsys.readouterr()
    assert main(args) == 0
    assert "nothing was generated in this run" in capsys.readouterr().out
    again, _ = read_outputs(output_dir)
    assert again["metrics"] == first["metrics"] and again["ref_logprob"] == first["ref_logprob"]
    assert main(args[:-1] + ["9"]) == 0  # --max-instances 9: three more instances, same job
    more, _ = read_outputs(output_dir)
    assert more["instances"] == 9 and more["generation"]["num_sequences"] == 3
    records = (output_dir / "results.jsonl").read_text().splitlines()
    assert len(records) == 2 * 9  # one generation and one reference score per instance, no repeats
    capsys.readouterr()
    assert main(args + ["--num-in-context", "2"]) == 2  # other settings: another job
    assert "different job" in capsys.readouterr().err


def test_user_errors_exit_2_with_one_line(tiny_opt, tmp_path, capsys):
    assert main(["bench", "--scenario", "squad", "--model", str(tiny_opt[0])]) == 2
    assert "known scenarios: wikifact, mmlu, synthetic_reasoning" in capsys.readouterr().err
    assert main(["bench", "--scenario", "xsum", "--model", str(tiny_opt[0])]) == 2
    assert "pass --data FILE" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input": "an article"}) + "\n")
    assert main(["bench", "--scenario", "xsum", "--model", str(tiny_opt[0]), "--data", str(bad),
                 "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "line 1: field 'references'" in err and err.count("\n") == 0
    assert not (tmp_path / "out").exists()


def test_summary_logprob_is_finite(tiny_opt, tmp_path, capsys):
    assert main(bench_args(tiny_opt[0], "wikifact", tmp_path / "w", "--num-in-context", "0")) == 0
    summary, rows = read_outputs(tmp_path / "w")
    assert summary["in_context_examples"] == {"min": 0, "max": 0}
    assert math.isfinite(summary["ref_logprob"]) and summary["ref_logprob_per_token"] < 0


def test_output_dir_on_a_file_is_refused_before_any_work(tiny_opt, tmp_path, capsys, monkeypatch):
    from flexoff.commands import harness as cli

    monkeypatch.setattr(cli, "make_llm", lambda *a, **k: pytest.fail("the model was loaded"))
    target = tmp_path / "results"
    target.write_text("my notes\n")
    # The data file does not exist either: the output directory is checked first.
    argv = ["bench", "--scenario", "xsum", "--model", str(tiny_opt[0]), "--data", str(tmp_path / "missing.jsonl"),
            "--output-dir"]
    assert main(argv + [str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flexoff: error: --output-dir {target} is a file, not a directory"
    assert target.read_text() == "my notes\n"
    assert main(argv + [str(target / "sub")]) == 2
    assert f"{target} is a file, not a directory" in capsys.readouterr().err


def test_failed_samples_are_kept_as_errors_and_exit_1(tiny_opt, tmp_path, capsys, monkeypatch):
    from .conftest import failing

    scenario = get_scenario("mmlu")
    instances = load_instances(scenario, DATA / CASES["mmlu"][0])
    examples = choose_examples([i for i in instances if i.split == "train"], scenario.num_in_context, 0)
    first = next(i for i in instances if i.split == "test")
    failing(monkeypatch, build_prompt(scenario, examples, first, "abstract algebra"))
    output_dir = tmp_path / "mmlu"
    assert main(bench_args(tiny_opt[0], "mmlu", output_dir)) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("flexoff: 1 of 4 sequences failed: logits turned non-finite") and "\n" not in err
    summary, rows = read_outputs(output_dir)
    assert summary["instances"] == 4 and rows[0]["predictions"] == [""]
