"""``flexoff batch`` end to end on a tiny checkpoint: results, resume after SIGKILL, refusals."""

import json
import os
import sys

import pytest

from flexoff import SamplingParams
from flexoff.commands.main import main
from flexoff.harness.store import read_records

from .conftest import REPO, failing, kill_after_lines, write_jsonl

WORDS = "the cat sat on the mat and the dog ran to the house".split()


def prompts(count):
    return [{"id": f"p{i}", "prompt": " ".join(WORDS[: 2 + (i * 7) % 11])} for i in range(count)]


def cli_command():
    return [sys.executable, "-m", "flexoff"]


def batch_args(model, source, output, *extra):
    return ["batch", "--model", str(model), "--input", str(source), "--output", str(output), "--no-progress",
            "--gpu-batch-size", "2", *extra]


def by_id(path):
    header, rows = read_records(path)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate ids"
    return header, {r["id"]: r for r in rows}


def test_results_match_the_api_and_honour_each_line(tiny_opt, tiny_llm, tmp_path, capsys):
    rows = prompts(9)
    rows[2]["max_new_tokens"] = 3
    rows[4]["stop"] = ["the"]
    rows[5]["meta"] = {"source": "b"}
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    assert main(batch_args(tiny_opt[0], source, output, "--max-new-tokens", "6")) == 0
    summary = capsys.readouterr().out
    assert "efficiency" in summary and "peak mem" in summary and "done       9 prompts" in summary
    _, results = by_id(output)
    assert set(results) == {r["id"] for r in rows}
    params = [SamplingParams(max_new_tokens=r.get("max_new_tokens", 6), stop=tuple(r.get("stop", ())))
              for r in rows]
    expected = tiny_llm.generate([r["prompt"] for r in rows], params)
    for row, out in zip(rows, expected):
        got = results[row["id"]]
        assert (got["token_ids"], got["text"], got["finish_reason"]) == (out.token_ids, out.text, out.finish_reason)
        assert got["logprobs"] == pytest.approx(out.logprobs, abs=1e-5)
        assert got["prompt_tokens"] == len(out.prompt_token_ids) and got["block_seconds"] >= 0
    assert len(results["p2"]["token_ids"]) <= 3
    assert results["p5"]["meta"] == {"source": "b"}


def few_shot(count):
    """Token-id prompts in groups of eight that share a 20-token prefix, as few-shot questions do."""
    rows = []
    for i in range(count):
        head = [4 + (i // 8 + j) % 30 for j in range(20)]
        rows.append({"id": f"p{i}", "prompt": head + [4 + (i * 5 + j) % 30 for j in range(1 + i % 5)]})
    return rows


@pytest.mark.parametrize("shape", ["words", "few-shot"])
def test_sigkill_then_rerun_equals_an_uninterrupted_run(tiny_opt, tmp_path, capsys, shape):
    """Only the killed job runs in a child: the uninterrupted one and the rerun run in-process. A
    few-shot job's blocks are formed by prefix, and its batches share them."""
    rows = prompts(32) if shape == "words" else few_shot(32)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    # Sampled, so a resumed job must seed each line by its id, not by its place in the job.
    flags = ("--max-new-tokens", "16", "--temperature", "0.8", "--seed", "5")
    flags += ("--gpu-batch-size", "4") if shape == "few-shot" else ()  # batches that hold a group or two
    reference = tmp_path / "reference.jsonl"
    assert main(batch_args(tiny_opt[0], source, reference, *flags)) == 0
    assert " shared · " in capsys.readouterr().out or shape == "words"

    output = tmp_path / "out.jsonl"
    written = kill_after_lines(cli_command() + batch_args(tiny_opt[0], source, output, *flags), output, 8, env)
    assert 8 <= written < 32  # one record a line, no header
    with open(output, "ab") as handle:  # as if the kill had landed in the middle of a write
        handle.write(b'{"id": "p3", "text": "half a li')

    capsys.readouterr()
    assert main(batch_args(tiny_opt[0], source, output, *flags)) == 0
    again = capsys.readouterr()
    assert "dropped a torn last line" in again.err
    assert f"({written} from an earlier run)" in again.out
    ref_header, ref = by_id(reference)
    header, got = by_id(output)
    assert header["fingerprint"] == ref_header["fingerprint"]
    assert set(got) == set(ref) and len(got) == 32
    for key in ref:
        assert (got[key]["text"], got[key]["token_ids"]) == (ref[key]["text"], ref[key]["token_ids"])


def test_rerun_of_a_finished_job_does_nothing(tiny_opt, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    output = tmp_path / "out.jsonl"
    assert main(batch_args(tiny_opt[0], source, output, "--max-new-tokens", "2")) == 0
    before = output.read_bytes()
    capsys.readouterr()
    assert main(batch_args(tiny_opt[0], source, output, "--max-new-tokens", "2")) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert output.read_bytes() == before


@pytest.mark.parametrize("change", ["input", "sampling", "model"])
def test_output_of_another_job_is_refused_and_kept(tiny_opt, tmp_path, capsys, change):
    source = write_jsonl(tmp_path / "in.jsonl", prompts(3))
    output = tmp_path / "out.jsonl"
    assert main(batch_args(tiny_opt[0], source, output, "--max-new-tokens", "2")) == 0
    before = output.read_bytes()
    capsys.readouterr()
    args = batch_args(tiny_opt[0], source, output, "--max-new-tokens", "2")
    if change == "input":
        write_jsonl(source, prompts(4))
    elif change == "sampling":
        args += ["--temperature", "0.5"]
    else:
        args[2] = "opt-125m"
        args.append("--dummy")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "different job" in err and "delete or move" in err
    assert output.read_bytes() == before


def test_prompt_too_long_names_its_line_and_writes_nothing(tiny_opt, tmp_path, capsys):
    rows = prompts(3)
    rows[1]["prompt"] = " ".join(["cat"] * 1200)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    assert main(batch_args(tiny_opt[0], source, output)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flexoff: error:") and "line 2 (id 'p1')" in err and "1024" in err
    assert not output.exists()


def test_malformed_input_exits_2_with_one_line(tiny_opt, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": 1, "prompt": "cat"}) + "\n{not json\n")
    assert main(batch_args(tiny_opt[0], source, tmp_path / "out.jsonl")) == 2
    err = capsys.readouterr().err.strip()
    assert "line 2: not valid JSON" in err and err.count("\n") == 0


def test_text_prompt_on_a_model_without_tokenizer(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": [5, 6, 7]}, {"id": 2, "prompt": "cat"}])
    config = {"model_type": "opt", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "ffn_dim": 32,
              "num_attention_heads": 2, "max_position_embeddings": 64, "bos_token_id": 2, "eos_token_id": 2}
    model = tmp_path / "dummy-opt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    assert main(batch_args(model, source, tmp_path / "out.jsonl", "--dummy")) == 2
    assert "line 2 (id 2): the prompt is text" in capsys.readouterr().err
    write_jsonl(source, [{"id": 1, "prompt": [5, 6, 7]}, {"id": 2, "prompt": [8, 9]}])
    assert main(batch_args(model, source, tmp_path / "out.jsonl", "--dummy", "--max-new-tokens", "3")) == 0
    _, results = by_id(tmp_path / "out.jsonl")
    assert results[1]["text"] is None and len(results[1]["token_ids"]) <= 3


def test_a_second_job_on_the_same_output_exits_2_and_a_third_resumes_the_first(tiny_opt, tmp_path, capsys,
                                                                              monkeypatch):
    from flexoff.api import LLM

    source = write_jsonl(tmp_path / "in.jsonl", prompts(9))
    flags = ("--max-new-tokens", "4")
    reference = tmp_path / "reference.jsonl"
    assert main(batch_args(tiny_opt[0], source, reference, *flags)) == 0
    output = tmp_path / "out.jsonl"
    second = {}
    original = LLM.generate

    def first_job(self, prompts, params=None, *, progress=False, on_block=None, **kwargs):
        def after_a_block(outputs, metrics):
            on_block(outputs, metrics)
            capsys.readouterr()
            second["code"] = main(batch_args(tiny_opt[0], source, output, *flags))  # while the first holds it
            second["err"] = capsys.readouterr().err
            raise KeyboardInterrupt  # then the first job stops, as if killed

        return original(self, prompts, params, progress=progress, on_block=after_a_block, **kwargs)

    monkeypatch.setattr(LLM, "generate", first_job)
    assert main(batch_args(tiny_opt[0], source, output, *flags)) == 130
    monkeypatch.undo()
    assert second["code"] == 2
    err = second["err"].strip()
    assert err.count("\n") == 0 and str(output) in err and "being written by another flexoff job" in err
    _, partial = by_id(output)
    assert 0 < len(partial) < 9  # the first job's block, nothing from the second
    before = output.read_bytes()
    assert main(batch_args(tiny_opt[0], source, output, *flags)) == 0
    assert output.read_bytes().startswith(before)
    _, ref = by_id(reference)
    _, got = by_id(output)
    assert set(got) == set(ref)
    for key in ref:
        assert (got[key]["text"], got[key]["token_ids"]) == (ref[key]["text"], ref[key]["token_ids"])


def test_a_failed_sequence_gets_an_error_record_counts_as_done_and_exits_1(tiny_opt, tmp_path, capsys,
                                                                          monkeypatch):
    rows = prompts(5)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    bad = tiny_opt[2](rows[3]["prompt"])["input_ids"]  # batch generates from token ids
    failing(monkeypatch, bad)
    assert main(batch_args(tiny_opt[0], source, output, "--max-new-tokens", "3")) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"flexoff: 1 of 5 sequences failed: logits turned non-finite at decode step 1 "
                   f"(their records in {output} say why)")
    data = output.read_bytes()
    assert b"NaN" not in data
    _, results = by_id(output)
    assert results["p3"]["finish_reason"] == "error" and results["p3"]["token_ids"] == []
    assert results["p3"]["error"] == "logits turned non-finite at decode step 1" and results["p3"]["text"] is None
    assert all(results[f"p{i}"]["error"] is None and results[f"p{i}"]["token_ids"] for i in (0, 1, 2, 4))
    assert main(batch_args(tiny_opt[0], source, output, "--max-new-tokens", "3")) == 1  # a result: not redone
    captured = capsys.readouterr()
    assert "nothing to do" in captured.out and "1 of 5 sequences failed" in captured.err
    assert output.read_bytes() == data


def test_an_output_of_the_older_layout_resumes(tiny_opt, tmp_path, capsys):
    from flexoff.harness.store import HEADER_KEY, job_path

    source = write_jsonl(tmp_path / "in.jsonl", prompts(6))
    reference = tmp_path / "reference.jsonl"
    assert main(batch_args(tiny_opt[0], source, reference, "--max-new-tokens", "3")) == 0
    job = json.loads(job_path(reference).read_text())
    lines = reference.read_text().splitlines()
    output = tmp_path / "old.jsonl"  # as the older version wrote it: the header, then records
    output.write_text("\n".join([json.dumps({HEADER_KEY: dict(job, format=1)}), *lines[:2]]) + "\n")
    assert main(batch_args(tiny_opt[0], source, output, "--max-new-tokens", "3")) == 0
    assert "(2 from an earlier run)" in capsys.readouterr().out
    assert output.read_text().splitlines()[:2] == lines[:2] and job_path(output).exists()
    _, ref = by_id(reference)
    _, got = by_id(output)
    assert {k: r["token_ids"] for k, r in got.items()} == {k: r["token_ids"] for k, r in ref.items()}


def test_a_full_disk_mid_job_is_one_line_and_the_rerun_finishes(tiny_opt, tmp_path, capsys, monkeypatch):
    import errno

    from flexoff.harness import store

    source = write_jsonl(tmp_path / "in.jsonl", prompts(6))
    output = tmp_path / "out.jsonl"
    original, calls = store._write_all, []

    def fills_up(fd, payload):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(fd, payload)

    monkeypatch.setattr(store, "_write_all", fills_up)
    assert main(batch_args(tiny_opt[0], source, output, "--max-new-tokens", "2")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"cannot write {output} (No space left on device)" in err
    assert "rerun the same command" in err
    _, kept = by_id(output)
    assert len(kept) == 2  # the first block of two
    monkeypatch.undo()
    assert main(batch_args(tiny_opt[0], source, output, "--max-new-tokens", "2")) == 0
    assert "(2 from an earlier run)" in capsys.readouterr().out
    assert len(by_id(output)[1]) == 6


def test_the_progress_bar_moves_with_tokens_and_tells_the_time_left(tiny_opt, tmp_path, monkeypatch):
    import flexoff.commands.harness as commands

    calls = []

    class Recorder:
        def __init__(self, enabled=True):
            pass

        def start(self, desc, unit, total, done):
            calls.append(("start", unit, total, done))
            assert desc == "generating"  # as flexoff run's bar, and the README, say

        def advance(self, count, note=""):
            calls.append(("advance", count, note))

        def finish(self):
            calls.append(("finish",))

    monkeypatch.setattr(commands, "TqdmProgress", Recorder)
    source = write_jsonl(tmp_path / "in.jsonl", prompts(4))
    assert main(batch_args(tiny_opt[0], source, tmp_path / "out.jsonl", "--max-new-tokens", "5",
                           "--ignore-eos")) == 0
    assert calls[0] == ("start", "tok", 20, 0) and calls[-1] == ("finish",)
    advances = [c for c in calls if c[0] == "advance"]
    # The bar's last note counts every prompt, the last block's included.
    assert advances[-1][2].endswith(", 4/4 prompts")
    assert sum(c[1] for c in advances) == 20
    # Tokens move the bar before the first block is written, and the time left is known by then.
    before_first_block = [c for c in advances if "0/4 prompts" in c[2]]
    assert sum(c[1] for c in before_first_block) >= 5
    assert any(" left, " in c[2] and not c[2].startswith("?") for c in before_first_block)
