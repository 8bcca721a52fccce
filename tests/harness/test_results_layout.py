"""One results layout: ``run``, ``batch`` and ``bench`` write records with the same fields, one a
line, that pandas and jq read as they are; ``index`` gives input order; UTF-8 stays UTF-8."""

import json
import shutil

import pandas
import pytest

from flexoff.commands.main import main
from flexoff.records import RECORD_FIELDS
from tests import processes

from .conftest import DATA, write_jsonl

PROMPTS = ["the cat sat on the mat and the dog ran", "café ✓ — naïve 日本", "the dog", "Question: Answer: A. B."]
INTEGER_COLUMNS = ("index", "prompt_tokens", "generated_tokens", "block_size")


@pytest.fixture(scope="module")
def outputs(tiny_opt, tmp_path_factory):
    """The results files of a run, a batch job and a bench run on the tiny checkpoint."""
    tmp = tmp_path_factory.mktemp("layout")
    rows = [{"id": f"q{i}", "prompt": p, "max_new_tokens": 2 + i} for i, p in enumerate(PROMPTS)]
    rows[1]["meta"] = {"note": "ünïcödé"}
    source = write_jsonl(tmp / "in.jsonl", [{k: v for k, v in r.items() if k != "meta"} for r in rows])
    batch_source = tmp / "batch.jsonl"
    batch_source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    model = str(tiny_opt[0])
    assert main(["run", "--model", model, "--prompts", str(source), "--output", str(tmp / "run.jsonl"), "--quiet",
                 "--gpu-batch-size", "2"]) == 0
    assert main(["batch", "--model", model, "--input", str(batch_source), "--output", str(tmp / "batch.jsonl.out"),
                 "--no-progress", "--gpu-batch-size", "2"]) == 0
    assert main(["bench", "--scenario", "mmlu", "--model", model, "--data", str(DATA / "abstract_algebra_test.jsonl"),
                 "--output-dir", str(tmp / "bench"), "--no-progress", "--gpu-batch-size", "4"]) == 0
    return {"run": tmp / "run.jsonl", "batch": tmp / "batch.jsonl.out", "bench": tmp / "bench" / "results.jsonl"}


@pytest.mark.parametrize("command", ["run", "batch", "bench"])
def test_pandas_reads_every_results_file_as_is(outputs, command):
    frame = pandas.read_json(outputs[command], lines=True)
    assert len(frame) == len(outputs[command].read_text(encoding="utf-8").splitlines())
    assert set(RECORD_FIELDS) <= set(frame.columns)
    for column in INTEGER_COLUMNS:
        assert pandas.api.types.is_integer_dtype(frame[column]), (column, frame[column].dtype)
    assert frame["index"].is_unique
    assert set(frame["finish_reason"].dropna()) <= {"stop", "length"}


def test_the_three_commands_write_the_same_fields(outputs):
    fields = {}
    for command, path in outputs.items():
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        fields[command] = {tuple(r)[:len(RECORD_FIELDS)] for r in records}
    assert fields["run"] == fields["batch"] == {RECORD_FIELDS}
    assert fields["bench"] == {RECORD_FIELDS}  # generations and reference scores alike


@pytest.mark.parametrize("command", ["run", "batch"])
def test_index_sorts_a_file_into_input_order_and_utf8_stays_utf8(outputs, command):
    data = outputs[command].read_bytes()
    assert "café ✓ — naïve 日本".encode() in data and b"\\u" not in data
    records = sorted((json.loads(line) for line in data.splitlines()), key=lambda r: r["index"])
    assert [r["id"] for r in records] == [f"q{i}" for i in range(len(PROMPTS))]
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["index"] for r in records] == list(range(len(PROMPTS)))
    if command == "batch":
        assert records[1]["meta"] == {"note": "ünïcödé"} and "ünïcödé".encode() in data


def test_run_and_batch_records_agree(outputs):
    def by_id(path):
        return {r["id"]: r for r in map(json.loads, path.read_text(encoding="utf-8").splitlines())}

    run, batch = by_id(outputs["run"]), by_id(outputs["batch"])
    for key, record in run.items():
        for field in ("index", "prompt", "prompt_tokens", "text", "token_ids", "generated_tokens", "finish_reason"):
            assert record[field] == batch[key][field], field


def test_bench_index_orders_each_instance_samples_then_score(outputs):
    records = sorted(map(json.loads, outputs["bench"].read_text(encoding="utf-8").splitlines()),
                     key=lambda r: r["index"])
    kinds = [r["kind"] for r in records]
    assert kinds == ["generate", "score"] * (len(records) // 2)
    assert all(g["id"][0] == s["id"][0] for g, s in zip(records[::2], records[1::2]))
    score = records[1]
    assert score["generated_tokens"] == 0 and score["prompt_tokens"] > 0 and score["text"]


@pytest.mark.skipif(shutil.which("jq") is None, reason="jq is not installed")
def test_jq_reads_a_results_file_as_is(outputs):
    done = processes.run(["jq", "-c", "[.index, .id, .generated_tokens]", str(outputs["batch"])])
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(rows) == sorted([r["index"], r["id"], r["generated_tokens"]]
                                  for r in map(json.loads, outputs["batch"].read_text().splitlines()))
