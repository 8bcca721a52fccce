"""The command line: the default job, prompt files, outputs, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from flexoff.cli import main
from tests.conftest import PROMPTS


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


BAD_CASES = {
    "unknown model": (["--model", "no-such-model"], "opt-125m"),
    "empty prompt file": (["--prompts", "{empty}"], "no prompts"),
    "missing prompt file": (["--prompts", "{missing}"], "cannot read"),
    "malformed jsonl": (["--prompts", "{malformed}"], "line 2: not valid JSON"),
    "bad max new tokens": (["--gen-len", "0"], "max_new_tokens"),
    "too long prompt": (["--prompt-len", "2048", "--num-prompts", "1"], "positions"),
    "bad batch size": (["--gpu-batch-size", "0"], "gpu_batch_size"),
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
