"""The command line: the default job, prompt files, outputs, and one-line errors with exit code 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flexoff.cli import main
from tests.conftest import PROMPTS

DATA = Path(__file__).parent / "harness" / "data"


def run_cli(*argv):
    """Run flexoff in a subprocess, as a user would, and return (code, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "flexoff.cli", *argv], capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_default_job_prints_throughput(capsys):
    assert main(["run", "--quiet", "--num-prompts", "3", "--prompt-len", "8", "--gen-len", "4"]) == 0
    out = capsys.readouterr().out
    for word in ("prefill", "decode", "total", "padded", "peak mem"):
        assert word in out


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
    assert main(["run", *common, "--policy", "auto", "--output", str(tmp_path / "auto.jsonl")]) == 0
    err = capsys.readouterr().err
    from flexoff.tokenizer import Tokenizer

    longest = max(len(Tokenizer(path).encode(p)) for p in PROMPTS)
    assert longest > max(len(p.split()) for p in PROMPTS) - 1  # tokens, not words or characters
    assert f"for prompt {longest}, generate 4 on " in err
    searched = tmp_path / "searched.json"
    assert main(["search", "--model", str(path), "--hardware", "t4", "--gpu-mem", "50KB", "--prompt-len",
                 str(longest), "--gen-len", "4", "--num-prompts", str(len(PROMPTS)), "--output", str(searched)]) == 0
    policy = json.loads(searched.read_text())
    assert policy["compress_weight"] is not None  # 50 KB is tight enough to change the policy
    assert f"searched   {policy['gpu_batch_size']}x{policy['num_gpu_batches']} " in err
    assert main(["run", *common, "--policy", str(searched), "--output", str(tmp_path / "file.jsonl")]) == 0
    assert (tmp_path / "auto.jsonl").read_text() == (tmp_path / "file.jsonl").read_text()


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
    assert len(out.read_text().splitlines()) == 4  # a header and three results


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
      "--policy", "auto", "--hardware", "t4", "--output-dir", "{tmp}"], "not `flexoff bench`"),
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
