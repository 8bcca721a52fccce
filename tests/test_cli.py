"""The command line: the default job, prompt files, outputs, and one-line errors with exit code 2."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from flexoff.commands.main import main
from tests import processes
from tests.conftest import PROMPTS, untimed_records

DATA = Path(__file__).parent / "harness" / "data"


def run_cli(*argv):
    """Run flexoff in a subprocess, as a user would, and return (code, stdout, stderr)."""
    proc = processes.run([sys.executable, "-m", "flexoff", *argv])
    return proc.returncode, proc.stdout, proc.stderr


def summary_numbers(out: str) -> dict[str, float]:
    """The figures of the printed run summary, by name."""
    numbers = {}
    for phase in ("prefill", "decode", "total"):
        rate, seconds = re.search(rf"^{phase} +([0-9.]+) token/s  \(([0-9.]+) s\)$", out, re.M).groups()
        numbers[f"{phase}_throughput"], numbers[f"{phase}_time"] = float(rate), float(seconds)
    tokens = re.search(r"^tokens +prompt (\d+) actual / (\d+) padded · generated (\d+) actual / (\d+) padded · "
                       r"efficiency ([0-9.]+)%$", out, re.M).groups()
    for name, value in zip(("prompt_tokens", "padded_prompt_tokens", "generated_tokens", "padded_generated_tokens",
                            "efficiency_percent"), tokens):
        numbers[name] = float(value)
    return numbers


def test_the_run_summary_counts_the_tokens_and_times_that_ran(tmp_path, capsys):
    """Prompts of three lengths and budgets in one block: the printed counts are the prompts' and the
    outputs' own, padding is the block's longest times its size, and every rate is tokens over seconds."""
    lengths, budgets = [10, 3, 6], [2, 5, 3]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": list(range(5, 5 + n)), "max_new_tokens": b}) + "\n"
                               for n, b in zip(lengths, budgets)))
    out, metrics_file = tmp_path / "out.jsonl", tmp_path / "metrics.json"
    assert main(["run", "--quiet", "--ignore-eos", "--prompts", str(prompts), "--output", str(out),
                 "--metrics-json", str(metrics_file)]) == 0
    printed = summary_numbers(capsys.readouterr().out)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    generated = sum(len(r["token_ids"]) for r in records)
    assert generated == sum(budgets)  # --ignore-eos: every budget is spent
    assert printed["prompt_tokens"] == sum(lengths) and printed["generated_tokens"] == generated
    assert printed["padded_prompt_tokens"] == len(lengths) * max(lengths)
    assert printed["padded_generated_tokens"] == len(budgets) * max(budgets)
    actual = sum(lengths) + generated
    assert printed["efficiency_percent"] == pytest.approx(100 * actual / (len(lengths) * (max(lengths) + max(budgets))),
                                                          abs=0.05)
    metrics = json.loads(metrics_file.read_text())  # the same figures, unrounded
    for name in ("prompt_tokens", "padded_prompt_tokens", "generated_tokens", "padded_generated_tokens"):
        assert metrics[name] == printed[name], name
    for name in ("prefill_time", "decode_time", "total_time"):
        assert metrics[name] == pytest.approx(printed[name], abs=5e-4), name
    rate = lambda tokens, seconds: pytest.approx(tokens / seconds, rel=1e-3, abs=0.05)  # noqa: E731  (print rounding)
    assert printed["prefill_throughput"] == rate(sum(lengths), metrics["prefill_time"])
    # Each sequence's first token comes from the prefill; decode makes the rest.
    assert printed["decode_throughput"] == rate(generated - len(lengths), metrics["decode_time"])
    assert printed["total_throughput"] == rate(generated, metrics["total_time"])
    assert metrics["total_time"] == pytest.approx(metrics["prefill_time"] + metrics["decode_time"], rel=1e-6)


def test_help_documents_every_run_flag():
    code, out, _ = run_cli("run", "--help")
    assert code == 0
    for flag in ("--model", "--dummy", "--prompts", "--prompt-len", "--gen-len", "--num-prompts", "--output",
                 "--policy", "--gpu-batch-size", "--temperature", "--top-p", "--top-k", "--stop", "--seed"):
        assert flag in out


def test_jsonl_prompts_to_output_file(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("opt-pre")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": p, "max_new_tokens": 2 + i})
                                 for i, p in enumerate(PROMPTS[:3])) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(["run", "--model", str(path), "--prompts", str(prompts), "--output", str(out), "--quiet",
                 "--ignore-eos"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["p0", "p1", "p2"]
    assert [len(r["token_ids"]) for r in rows] == [2, 3, 4]
    assert all(len(r["logprobs"]) == len(r["token_ids"]) and all(lp <= 0 for lp in r["logprobs"]) for r in rows)


def test_policy_auto_searches_for_the_job_and_runs_what_it_found(tiny_model_dir, tmp_path, capsys):
    """The job's workload is its longest prompt in tokens and its largest budget; the run equals one
    with the policy `flexoff search` saves for that workload."""
    path, _ = tiny_model_dir("opt-pre")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    common = ["--model", str(path), "--prompts", str(prompts), "--hardware", "t4", "--dtype", "bfloat16",
              "--gpu-mem", "50KB", "--gen-len", "4", "--quiet", "--ignore-eos"]
    assert main(["run", *common, "--policy", "auto", "--compress", "auto",
                 "--output", str(tmp_path / "auto.jsonl")]) == 0
    err = capsys.readouterr().err
    from flexoff.tokenizer import Tokenizer

    longest = max(len(Tokenizer(path).encode(p)) for p in PROMPTS)
    assert longest > max(len(p.split()) for p in PROMPTS) - 1  # tokens, not words or characters
    assert f"for prompt {longest}, generate 4 on " in err
    searched = tmp_path / "searched.json"
    assert main(["search", "--model", str(path), "--hardware", "t4", "--gpu-mem", "50KB", "--prompt-len",
                 str(longest), "--gen-len", "4", "--num-prompts", str(len(PROMPTS)), "--compress", "auto",
                 "--output", str(searched)]) == 0
    policy = json.loads(searched.read_text())
    assert policy["compress_weight"] is not None  # 50 KB is tight enough to change the policy
    assert f"searched   {policy['gpu_batch_size']}x{policy['num_gpu_batches']} " in err
    assert main(["run", *common, "--policy", str(searched), "--output", str(tmp_path / "file.jsonl")]) == 0
    assert untimed_records(tmp_path / "auto.jsonl") == untimed_records(tmp_path / "file.jsonl")


def test_policy_auto_in_a_batch_job_plans_for_the_prompts_left(tiny_model_dir, tmp_path, capsys):
    path, _ = tiny_model_dir("opt-pre")
    lines = tmp_path / "in.jsonl"
    lines.write_text("\n".join(json.dumps({"id": i, "prompt": p, "max_new_tokens": 2 + i})
                               for i, p in enumerate(PROMPTS[:3])) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["batch", "--model", str(path), "--input", str(lines), "--output", str(out), "--policy", "auto",
            "--hardware", "t4", "--dtype", "bfloat16", "--no-progress"]
    assert main(argv) == 0
    from flexoff.tokenizer import Tokenizer

    longest = max(len(Tokenizer(path).encode(p)) for p in PROMPTS[:3])
    assert f"for prompt {longest}, generate 4 on " in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 3  # one record a line


def test_the_python_api_points_policy_auto_to_the_planner():
    from flexoff import LLM
    from flexoff.errors import FlexoffError

    with pytest.raises(FlexoffError, match="search_policy"):
        LLM("opt-125m", dummy=True, policy="auto")


@pytest.mark.parametrize("argv, message", [
    (["run", "--policy", "auto", "--hardware", "t4", "--dtype", "float32"], "plans 16-bit weights"),
    (["run", "--policy", "auto", "--hardware", "t5", "--dtype", "bfloat16"], "neither a file nor a packaged profile"),
    (["run", "--policy", "auto", "--hardware", "t4", "--dtype", "bfloat16", "--gpu-mem", "1KB"],
     "cannot run on this machine even with everything offloaded"),
    (["bench", "--scenario", "xsum", "--data", str(DATA / "xsum.jsonl"), "--model", "opt-125m", "--dummy",
      "--policy", "auto", "--hardware", "t4", "--dtype", "bfloat16", "--output-dir", "{tmp}"],
     "scenarios are text; model 'opt-125m' has no tokenizer"),
])
def test_policy_auto_bad_input_is_one_line_and_exit_2(argv, message, tmp_path):
    code, out, err = run_cli(*(arg.replace("{tmp}", str(tmp_path / "bench")) for arg in argv))
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


BAD_CASES = {
    "unknown model": (["--model", "no-such-model"], "opt-125m"),
    "empty prompt file": (["--prompts", "{empty}"], "no prompts"),
    "missing prompt file": (["--prompts", "{missing}"], "cannot read"),
    "malformed jsonl": (["--prompts", "{malformed}"], "line 2: not valid JSON"),
    "bad max new tokens": (["--gen-len", "0"], "--gen-len/--max-new-tokens: must be an integer >= 1"),
    "too long prompt": (["--prompt-len", "2048", "--num-prompts", "1"], "positions"),
    "bad batch size": (["--gpu-batch-size", "0"], "--gpu-batch-size: must be an integer >= 1"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    files = {"empty": tmp_path / "empty.txt", "missing": tmp_path / "missing.txt",
             "malformed": tmp_path / "bad.jsonl"}
    files["empty"].write_text("\n\n")
    files["malformed"].write_text('{"prompt": [5, 6]}\n{"prompt": oops}\n')
    argv, needle = BAD_CASES[case]
    argv = [a.format(**files) for a in argv]
    code, _, err = run_cli("run", "--quiet", *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexoff: error:"), err
    assert needle in lines[0]
    assert "Traceback" not in err


def _no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the destinations were checked")


@pytest.mark.parametrize("flag, make, needle", [
    ("--output", lambda tmp: tmp.joinpath("dir").mkdir() or tmp / "dir", "is a directory"),
    ("--output", lambda tmp: tmp.joinpath("file").write_text("x") and tmp / "file" / "out.jsonl",
     "is a file, not a directory"),
    ("--output", lambda tmp: tmp.joinpath("f").write_text("x") and tmp / "f" / "sub" / "out.jsonl",
     "is a file, not a directory"),
    ("--metrics-json", lambda tmp: tmp.joinpath("m").mkdir() or tmp / "m", "is a directory"),
])
def test_run_checks_its_destinations_before_loading_the_model(tmp_path, capsys, monkeypatch, flag, make, needle):
    from flexoff.commands import main as cli

    monkeypatch.setattr(cli, "make_llm", _no_model)
    target = make(tmp_path)
    assert main(["run", "--quiet", flag, str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flexoff: error: {flag} ") and needle in err and "\n" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_run_refuses_a_read_only_output_and_an_unwritable_folder(tmp_path, capsys, monkeypatch):
    from flexoff.commands import main as cli

    monkeypatch.setattr(cli, "make_llm", _no_model)
    read_only = tmp_path / "results.jsonl"
    read_only.write_text("")
    read_only.chmod(0o444)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert main(["run", "--quiet", "--output", str(read_only)]) == 2
        assert "is read-only" in capsys.readouterr().err
        assert main(["run", "--quiet", "--metrics-json", str(locked / "m.json")]) == 2
        assert f"cannot write in {locked}" in capsys.readouterr().err
    finally:
        locked.chmod(0o755)


def test_a_full_disk_at_the_end_keeps_the_results_and_says_where(tmp_path, capsys, monkeypatch):
    """The write fails after generating: one line names the failure and the file that holds the results."""
    import errno
    import tempfile

    from flexoff import fileio

    original = fileio.write_text_atomic
    full = tmp_path / "full"

    def write(path, text):
        if full in Path(path).parents:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(path, text)

    monkeypatch.setattr(fileio, "write_text_atomic", write)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = full / "out.jsonl"
    argv = ["run", "--quiet", "--num-prompts", "3", "--prompt-len", "8", "--gen-len", "2", "--output", str(out),
            "--metrics-json", str(tmp_path / "metrics.json")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "decode" in captured.out  # the run itself finished and reported
    err = captured.err.strip()
    assert "\n" not in err and f"cannot write {out} (No space left on device)" in err
    kept = Path(err.rsplit(" kept in ", 1)[1])
    assert kept.parent == tmp_path / "tmp" and not out.exists()
    records = [json.loads(line) for line in kept.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2] and all(len(r["token_ids"]) == 2 for r in records)
    assert json.loads((tmp_path / "metrics.json").read_text())["num_sequences"] == 3


def test_failed_sequences_get_error_records_and_exit_1(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from tests.harness.conftest import failing

    path, _ = tiny_model_dir("opt-pre")
    capsys.readouterr()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
    failing(monkeypatch, PROMPTS[1], reason="logits turned non-finite (layer 0 weight)")
    out = tmp_path / "out.jsonl"
    assert main(["run", "--model", str(path), "--prompts", str(prompts), "--output", str(out), "--quiet",
                 "--gen-len", "3"]) == 1
    captured = capsys.readouterr()
    assert "decode" in captured.out and f"wrote 3 results to {out}" in captured.out
    assert captured.err.strip() == (f"flexoff: 1 of 3 sequences failed: logits turned non-finite (layer 0 weight) "
                                    f"(their records in {out} say why)")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["finish_reason"] == "error" for r in records] == [False, True, False]
    assert records[1]["error"] == "logits turned non-finite (layer 0 weight)" and records[1]["token_ids"] == []
    assert all(r["error"] is None and len(r["token_ids"]) >= 1 for r in (records[0], records[2]))


def _summary_sizes(line: str, label: str) -> dict[str, int]:
    """``{tier: bytes}`` from a summary line such as 'weights    device (cpu) 1.50 KiB · cpu 0 B'."""
    import re

    from flexoff.units import parse_size

    assert line.startswith(label), line
    return {name: parse_size(size) for name, size in
            re.findall(r"([a-z]+(?: \([a-z:0-9]+\))?) ([0-9.]+ [KMGT]?i?B)", line[len(label):])}


def test_the_summary_names_the_tiers_as_they_are_and_tells_where_every_weight_is(tiny_model_dir, tmp_path, capsys):
    """On a CPU the "gpu" tier is the CPU: the summary says so, and its byte counts are the placement's."""
    from flexoff.models import resolve_model_config
    from flexoff.models import stage_specs, stages

    path, _ = tiny_model_dir("opt-pre")
    percent = ["40", "30", "50", "50", "100", "0"]
    metrics_file = tmp_path / "metrics.json"
    assert main(["run", "--model", str(path), "--quiet", "--prompt-len", "8", "--gen-len", "3", "--num-prompts", "4",
                 "--percent", *percent, "--offload-dir", str(tmp_path), "--metrics-json", str(metrics_file)]) == 0
    lines = {line[:11]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["policy     "].startswith("policy     % on device (cpu)/cpu/disk: weights requested 40.0/30.0/30.0")
    weights = _summary_sizes(lines["weights    "], "weights    ")
    config = resolve_model_config(str(path))
    total = sum(spec.numel for stage in stages(config) for spec in stage_specs(config, stage)) * 4  # float32
    realised = lines["policy     "].split("realised ")[1].split()[0].split("/")
    assert list(weights) == ["device (cpu)", "cpu", "disk"]
    assert sum(weights.values()) == pytest.approx(total, abs=20)  # every weight, each size printed to 0.01 KiB
    for share, name in zip(realised, weights):
        assert weights[name] == pytest.approx(total * float(share) / 100, abs=total * 6e-4)
    peaks = json.loads(metrics_file.read_text())["peak_memory"]
    printed = _summary_sizes(lines["peak mem   "], "peak mem   ")
    assert lines["peak mem   "].startswith("peak mem   ram ") and "the device (cpu) and cpu tiers" in lines["peak mem   "]
    assert printed["ram"] == pytest.approx(peaks["cpu_rss"], rel=5e-3)
    assert printed["disk"] == pytest.approx(peaks["disk"], rel=5e-3)
    assert "cpu_weights" not in lines["peak mem   "] and "gpu_store_stream_peak" not in lines["peak mem   "]


def test_memory_running_out_past_the_plan_is_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """An allocation the plan did not foresee fails the run with one line, not a traceback."""
    import torch

    from flexoff.commands.main import main
    from flexoff.models import llama

    def exhausted(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 384.00 MiB. GPU 0 has a total capacity")

    monkeypatch.setattr(llama, "_rotate", exhausted)
    path, _ = tiny_model_dir("llama-gqa")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a dog\n")
    capsys.readouterr()
    assert main(["run", "--model", str(path), "--prompts", str(prompts), "--gen-len", "2", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith("flexoff: error: out of GPU memory while running (CUDA out of memory. Tried to "
                             "allocate 384.00 MiB)"), err


def test_output_piped_into_a_reader_that_stops_early_ends_quietly():
    """`flexoff search ... | head -1`: the reader may close the pipe before the search prints; the
    search must end without a traceback (exit 141, as a shell reports SIGPIPE), not with
    BrokenPipeError's. `true` reads nothing, and exits long before the search has imported torch."""
    command = (f"{sys.executable} -m flexoff search --model opt-30b --hardware h100 --gpu-mem 16GiB"
               " | true; echo \"rc=${PIPESTATUS[0]}\"")
    proc = processes.run(["bash", "-c", command])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.strip().endswith("rc=141"), proc.stdout
