"""Compression is the user's choice: planning is lossless unless --compress auto|on, a forced part
or a compressed policy file contradicts --compress off, and a compressed run says it is lossy."""

import json

import pytest

from flexoff.commands.main import main
from tests.conftest import PROMPTS

# Tight enough that only a compressed policy fits the tiny model.
TIGHT = ["--hardware", "t4", "--dtype", "bfloat16", "--gpu-mem", "60KB"]


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexoff: error: "), lines
    return lines[0]


@pytest.fixture
def tiny(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("opt-pre")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:3])))
    return str(path), str(prompts)


def check_planned(code: int, capsys, lossy: bool) -> None:
    """Told to compress, planning compresses; else it plans lossless, which does not fit."""
    if lossy:
        assert code == 0
        assert " 4-bit for prompt " in capsys.readouterr().err
    else:
        assert code == 2
        assert "no compression" in one_error_line(capsys)


@pytest.mark.parametrize("compress, lossy", [(None, False), ("auto", True)])
def test_run_policy_auto_is_lossless_unless_told(tiny, capsys, compress, lossy):
    model, prompts = tiny
    flags = ["--compress", compress] if compress else []
    argv = ["run", "--model", model, "--prompts", prompts, *TIGHT, "--gen-len", "2", "--quiet", "--policy", "auto"]
    check_planned(main(argv + flags), capsys, lossy)


@pytest.mark.parametrize("compress, lossy", [(None, False), ("auto", True)])
def test_batch_policy_auto_is_lossless_unless_told(tiny, tmp_path, capsys, compress, lossy):
    model, prompts = tiny
    flags = ["--compress", compress] if compress else []
    argv = ["batch", "--model", model, "--input", prompts, "--output", str(tmp_path / "out.jsonl"), *TIGHT,
            "--max-new-tokens", "2", "--no-progress", "--policy", "auto"]
    check_planned(main(argv + flags), capsys, lossy)


@pytest.mark.parametrize("compress, lossy", [(None, False), ("auto", True)])
def test_search_is_lossless_unless_told(tmp_path, capsys, compress, lossy):
    output = tmp_path / "policy.json"
    flags = ["--compress", compress] if compress else []
    assert main(["search", "--model", "opt-66b", "--hardware", "t4",
                 "--output", str(output), *flags]) == 0
    policy = json.loads(output.read_text())
    assert (policy["compress_weight"] is not None or policy["compress_cache"] is not None) == lossy


@pytest.mark.parametrize("command", ["run", "batch", "search"])
def test_an_unknown_compress_value_is_one_line_and_exit_2(capsys, command):
    assert main([command, "--compress", "maybe"]) == 2
    line = one_error_line(capsys)
    assert "argument --compress: invalid choice: 'maybe'" in line


@pytest.mark.parametrize("force", [["--compress-weight"], ["--compress-cache"], ["--compress-weight", "--compress-cache"]])
def test_forcing_compression_contradicts_compress_off(tiny, capsys, force):
    model, prompts = tiny
    assert main(["run", "--model", model, "--prompts", prompts, "--compress", "off", *force]) == 2
    line = one_error_line(capsys)
    assert "contradicts --compress off" in line and force[0] in line
    # Forcing a part without --compress is the user's choice and runs.
    assert main(["run", "--model", model, "--prompts", prompts, "--gen-len", "2", "--quiet",
                 "--compress-weight"]) == 0


def test_a_compressed_policy_file_contradicts_compress_off(tiny, tmp_path, capsys):
    model, prompts = tiny
    path = tmp_path / "lossy.json"
    path.write_text(json.dumps({"compress_cache": {"bits": 4, "group_size": 64}}))
    assert main(["run", "--model", model, "--prompts", prompts, "--policy", str(path), "--compress", "off"]) == 2
    line = one_error_line(capsys)
    assert str(path) in line and "cache" in line and "contradicts --compress off" in line
    # Without --compress off the file is the user's choice and runs.
    assert main(["run", "--model", model, "--prompts", prompts, "--policy", str(path), "--gen-len", "2",
                 "--quiet"]) == 0


def test_a_compressed_run_says_lossy_and_records_its_policy(tiny, tmp_path, capsys):
    model, prompts = tiny
    metrics = tmp_path / "metrics.json"
    assert main(["run", "--model", model, "--prompts", prompts, "--gen-len", "2", "--quiet", "--compress-weight",
                 "--weight-bits", "8", "--metrics-json", str(metrics)]) == 0
    policy_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("policy"))
    assert policy_line.endswith(" · weights 8-bit (lossy)")
    recorded = json.loads(metrics.read_text())["policy"]
    assert recorded["compress_weight"] == {"bits": 8, "group_size": 64} and recorded["compress_cache"] is None
    assert main(["run", "--model", model, "--prompts", prompts, "--gen-len", "2", "--quiet",
                 "--metrics-json", str(metrics)]) == 0
    assert "lossy" not in capsys.readouterr().out
    assert json.loads(metrics.read_text())["policy"]["compress_weight"] is None


def test_a_batch_job_file_records_the_policy_that_ran(tiny, tmp_path, capsys):
    model, prompts = tiny
    out = tmp_path / "out.jsonl"
    assert main(["batch", "--model", model, "--input", prompts, "--output", str(out), "--max-new-tokens", "2",
                 "--no-progress", "--compress-cache"]) == 0
    assert "cache 4-bit (lossy)" in capsys.readouterr().out
    policy = json.loads((tmp_path / "out.jsonl.job.json").read_text())["policy"]
    assert policy["compress_cache"] == {"bits": 4, "group_size": 64} and policy["compress_weight"] is None


def test_a_batch_job_resumes_only_with_the_compression_it_began_with(tiny, tmp_path, capsys):
    """Compressed and lossless tokens differ: a half-done compressed job refuses a lossless resume, and
    finishes under its own compression."""
    model, prompts = tiny
    out = tmp_path / "out.jsonl"
    base = ["batch", "--model", model, "--input", prompts, "--output", str(out), "--max-new-tokens", "2",
            "--no-progress"]
    assert main([*base, "--compress-weight"]) == 0
    first, *rest = out.read_text().splitlines(keepends=True)
    out.write_text(first)  # as if the job had died after its first result
    capsys.readouterr()
    assert main(base) == 2
    line = one_error_line(capsys)
    assert str(out) in line and "weights 4-bit" in line and "lossless weights" in line
    assert out.read_text() == first  # nothing mixed in
    assert main([*base, "--compress-weight"]) == 0
    assert len(out.read_text().splitlines()) == 1 + len(rest)
