"""``flexoff bench`` end to end: every shipped scenario on the tiny checkpoint."""

import json
import math
import re

import pytest
import torch

from flexoff.commands.main import main
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


def table_values(table: str) -> dict[str, float]:
    """The numbers of the printed summary table, by the label before each."""
    values = {}
    for line in table.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in ("exact_match", "quasi_exact_match", "f1_set_match", "iou_set_match",
                                            "exact_set_match", "rouge_l", "f1", "ref_logprob"):
            values[words[0]] = float(words[1])
        elif line.startswith("throughput"):
            numbers = re.findall(r"(\w+) ([0-9.]+)(?: token/s|%)", line)
            values.update((f"throughput {name}", float(number)) for name, number in numbers)
        elif line.startswith("wall time"):
            values["wall"] = float(words[2])
    return values


@pytest.mark.parametrize("name", list(CASES))
def test_scenario_runs_end_to_end(tiny_opt, tmp_path, capsys, name):
    """The summary file and the printed table agree with the per-instance rows and the raw results,
    each recomputed here by its plain definition."""
    scenario = get_scenario(name)
    output_dir = tmp_path / name
    assert main(bench_args(tiny_opt[0], name, output_dir)) == 0
    table = table_values(capsys.readouterr().out)
    summary, rows = read_outputs(output_dir)
    records = [json.loads(line) for line in (output_dir / "results.jsonl").read_text().splitlines()]
    samples = {(r["id"][0], r["id"][1]): r for r in records if r["kind"] != "score"}
    scores = {r["id"][0]: r for r in records if r["kind"] == "score"}
    assert summary["instances"] == len(rows) == CASES[name][1]
    for row in rows:
        # The predictions are the generated texts, and the reference's log-probability their sum.
        assert row["predictions"] == [samples[(row["id"], j)]["text"] for j in range(scenario.num_outputs)]
        assert row["ref_logprob"] == pytest.approx(sum(scores[row["id"]]["logprobs"]))
        assert row["ref_tokens"] == len(scores[row["id"]]["logprobs"]) >= 1 and row["ref_logprob"] < 0
        if "exact_match" in scenario.metrics:
            assert row["exact_match"] == float(any(p.strip() == r.strip() for p in row["predictions"]
                                                   for r in row["references"]))
        assert all(0 <= row[metric] <= 1 for metric in scenario.metrics)
    for metric in scenario.metrics:
        mean = sum(r[metric] for r in rows) / len(rows)
        assert summary["metrics"][metric] == pytest.approx(mean)
        assert table[metric] == pytest.approx(mean, abs=5e-5)
    assert summary["ref_logprob"] == pytest.approx(sum(r["ref_logprob"] for r in rows) / len(rows))
    assert summary["ref_logprob_per_token"] == pytest.approx(sum(r["ref_logprob"] for r in rows)
                                                             / sum(r["ref_tokens"] for r in rows))
    assert table["ref_logprob"] == pytest.approx(summary["ref_logprob"], abs=5e-5)
    assert summary["in_context_examples"] == {"min": min(r["num_in_context"] for r in rows),
                                              "max": max(r["num_in_context"] for r in rows)}
    assert summary["truncated_prompts"] == sum(r["truncated"] for r in rows)
    generation = summary["generation"]
    assert generation["num_sequences"] == len(samples) == len(rows) * scenario.num_outputs
    assert generation["generated_tokens"] == sum(len(r["token_ids"]) for r in samples.values())
    actual = generation["prompt_tokens"] + generation["generated_tokens"]
    padded = generation["padded_prompt_tokens"] + generation["padded_generated_tokens"]
    assert generation["efficiency"] == pytest.approx(actual / padded) and actual <= padded
    assert table["throughput efficiency"] == pytest.approx(100 * actual / padded, abs=0.05)
    assert table["throughput actual"] == pytest.approx(actual / generation["total_time"], abs=0.05)
    assert table["throughput padded"] == pytest.approx(padded / generation["total_time"], abs=0.05)
    assert table["wall"] == pytest.approx(summary["wall_seconds"], abs=0.05)
    assert summary["wall_seconds"] >= generation["total_time"]


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


def test_policy_auto_plans_for_the_prompts_the_scenario_builds(tiny_opt, tmp_path, capsys, monkeypatch):
    """--policy auto searches a policy for the scenario's own prompts: the longest as fitted to the
    context, the scenario's generation budget, and the in-context examples every prompt begins
    with as the job's shared prefix."""
    import flexoff.prompts

    planned = []
    measure = flexoff.prompts.prompt_workload

    def recording(*args, **kwargs):
        planned.append(measure(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(flexoff.prompts, "prompt_workload", recording)
    output_dir = tmp_path / "auto"
    assert main(["bench", "--scenario", "synthetic_reasoning", "--model", str(tiny_opt[0]), "--max-instances", "6",
                 "--output-dir", str(output_dir), "--no-progress", "--policy", "auto", "--hardware", "t4",
                 "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    scenario = get_scenario("synthetic_reasoning")
    records = [json.loads(line) for line in (output_dir / "results.jsonl").read_text().splitlines()]
    generated = [r for r in records if r.get("kind") == "generate"]
    longest = max(r["prompt_tokens"] for r in generated)
    [workload] = planned
    assert (workload.prompt_len, workload.gen_len, workload.num_prompts) == (longest, scenario.max_new_tokens, 6)
    assert 0 < workload.shared_prefix < longest  # the five examples, not the question
    assert f"for prompt {longest}, generate {scenario.max_new_tokens} on t4" in err
    summary, _ = read_outputs(output_dir)
    assert summary["generation"]["shared_prompt_tokens"] > 0


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
