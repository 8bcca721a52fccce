"""Every write path on a full disk: one line naming the file, exit code 2, the results written so
far kept and resumable, and no partial file, temporary file or lock left behind.

The disk is faked full at ``os.write`` (see full_disk.py), for the files each test picks."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexoff.commands.main import main
from flexoff.harness.store import read_records

from .conftest import REPO, write_jsonl
from .full_disk import enospc_writes, under

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names written files through /proc")

WORDS = "the cat sat on the mat and the dog ran to the house".split()
SPACE = "No space left on device"


def lines(count):
    return [{"id": f"p{i}", "prompt": " ".join(WORDS[: 2 + (i * 5) % 9])} for i in range(count)]


def openai_lines(count):
    return [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": " ".join(WORDS[: 2 + i % 7]), "max_tokens": 2}} for i in range(count)]


def batch(model, source, output):
    # Blocks of two prompts: a job of six has a first block and later ones.
    return ["batch", "--model", str(model), "--input", str(source), "--output", str(output), "--no-progress",
            "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--max-new-tokens", "2"]


def fill(monkeypatch, full):
    """From now on the disk is full where ``full`` says (and only there: an earlier fill is replaced)."""
    monkeypatch.setattr(os, "write", enospc_writes(full))


def one_line(capsys, *names) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flexoff: error: ") and "Traceback" not in err, err
    for name in names:
        assert str(name) in err, (name, err)
    assert SPACE in err
    return err


def left_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def named(name):
    return lambda path, fd: path.name == name


def not_probe(full):
    """``full``, except for the probe that checks a destination before any work: the disk fills later."""
    return lambda path, fd: not path.name.startswith(".flexoff-probe-") and full(path, fd)


@pytest.mark.parametrize("rows", [lines, openai_lines], ids=["plain", "openai"])
def test_the_lock_write_before_the_first_block(tiny_opt, tmp_path, capsys, monkeypatch, rows):
    source = write_jsonl(tmp_path / "in.jsonl", rows(4))
    out = tmp_path / "out" / "results.jsonl"
    out.parent.mkdir()
    fill(monkeypatch, named(".results.jsonl.lock"))
    assert main(batch(tiny_opt[0], source, out)) == 2
    one_line(capsys, out.parent / ".results.jsonl.lock")
    assert left_in(out.parent) == []
    monkeypatch.undo()
    assert main(batch(tiny_opt[0], source, out)) == 0
    assert len(read_records(out)[1]) == 4


@pytest.mark.parametrize("rows", [lines, openai_lines], ids=["plain", "openai"])
@pytest.mark.parametrize("which", ["results.jsonl", ".results.jsonl.job.json."])
def test_the_first_block(tiny_opt, tmp_path, capsys, monkeypatch, rows, which):
    source = write_jsonl(tmp_path / "in.jsonl", rows(6))
    out = tmp_path / "out" / "results.jsonl"
    out.parent.mkdir()
    fill(monkeypatch, lambda path, fd: path.name.startswith(which))  # the results, or the job file's temporary
    assert main(batch(tiny_opt[0], source, out)) == 2
    err = one_line(capsys, out if which == "results.jsonl" else f"{out}.job.json")
    assert "rerun the same command" in err
    assert left_in(out.parent) == []  # no empty results, job file, temporary or lock
    monkeypatch.undo()
    assert main(batch(tiny_opt[0], source, out)) == 0
    assert len(read_records(out)[1]) == 6


def appended(path, fd) -> bool:
    """A write to a results file that already holds records: a later block."""
    return path.name == "results.jsonl" and os.fstat(fd).st_size > 0


@pytest.mark.parametrize("rows", [lines, openai_lines], ids=["plain", "openai"])
def test_a_later_block_then_a_rerun_on_the_still_full_disk(tiny_opt, tmp_path, capsys, monkeypatch, rows):
    source = write_jsonl(tmp_path / "in.jsonl", rows(6))
    out = tmp_path / "out" / "results.jsonl"
    out.parent.mkdir()
    fill(monkeypatch, appended)
    assert main(batch(tiny_opt[0], source, out)) == 2
    one_line(capsys, out, "the 2 results before this block are kept")
    kept = out.read_bytes()
    assert len(read_records(out)[1]) == 2
    assert left_in(out.parent) == ["results.jsonl", "results.jsonl.job.json"]
    # Resumed with no room at all: the job file is not rewritten, the records stay, no lock stays.
    fill(monkeypatch, not_probe(under(out.parent)))
    assert main(batch(tiny_opt[0], source, out)) == 2
    one_line(capsys, out)
    assert out.read_bytes() == kept
    assert left_in(out.parent) == ["results.jsonl", "results.jsonl.job.json"]
    monkeypatch.undo()
    assert main(batch(tiny_opt[0], source, out)) == 0
    assert "(2 from an earlier run)" in capsys.readouterr().out
    assert len(read_records(out)[1]) == 6


def test_a_resumed_job_under_another_policy_cannot_rewrite_its_job_file(tiny_opt, tmp_path, capsys, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", lines(4))
    out = tmp_path / "out" / "results.jsonl"
    out.parent.mkdir()
    fill(monkeypatch, appended)
    assert main(batch(tiny_opt[0], source, out)) == 2
    capsys.readouterr()
    kept, job = out.read_bytes(), (out.parent / "results.jsonl.job.json").read_bytes()
    fill(monkeypatch, lambda path, fd: path.name.startswith(".results.jsonl.job.json."))  # its temporary
    argv = batch(tiny_opt[0], source, out)
    argv[argv.index("--gpu-batch-size") + 1] = "1"  # another lossless policy, which the job file records
    assert main(argv) == 2
    one_line(capsys, f"{out}.job.json", "the 2 results")
    assert out.read_bytes() == kept and (out.parent / "results.jsonl.job.json").read_bytes() == job
    assert left_in(out.parent) == ["results.jsonl", "results.jsonl.job.json"]


def test_a_lock_path_that_is_a_directory_is_one_line(tiny_opt, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", lines(2))
    out = tmp_path / "results.jsonl"
    (tmp_path / ".results.jsonl.lock").mkdir()
    assert main(batch(tiny_opt[0], source, out)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "is a directory" in err
    assert f"{tmp_path / '.results.jsonl.lock'}" in err
    assert not out.exists() and (tmp_path / ".results.jsonl.lock").is_dir()


def bench(model, output_dir):
    return ["bench", "--scenario", "synthetic_reasoning", "--model", str(model), "--output-dir", str(output_dir),
            "--no-progress", "--gpu-batch-size", "4", "--max-instances", "4"]


def test_bench_first_block_and_its_last_files(tiny_opt, tmp_path, capsys, monkeypatch):
    output_dir = tmp_path / "bench"
    fill(monkeypatch, lambda path, fd: path.name.startswith(".results.jsonl.job.json."))
    assert main(bench(tiny_opt[0], output_dir)) == 2
    one_line(capsys, output_dir / "results.jsonl.job.json")
    assert left_in(output_dir) == []
    # Room for the results, none for the summary: kept elsewhere, named, and the results stay resumable.
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    fill(monkeypatch, lambda path, fd: path.name.startswith(".summary.json."))
    assert main(bench(tiny_opt[0], output_dir)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write {output_dir / 'summary.json'} ({SPACE})" in err
    kept = Path(err.rsplit(" kept in ", 1)[1].strip())
    assert json.loads(kept.read_text())["instances"] == 4
    assert left_in(output_dir) == ["instances.jsonl", "results.jsonl", "results.jsonl.job.json"]
    monkeypatch.undo()
    assert main(bench(tiny_opt[0], output_dir)) == 0
    assert "nothing was generated in this run" in capsys.readouterr().out


SEARCH = ["search", "--model", "opt-1.3b", "--hardware", "t4", "--prompt-len", "64", "--gen-len", "8"]


@pytest.mark.parametrize("flag", ["--output", "--pareto-csv"])
def test_search_outputs(tmp_path, capsys, monkeypatch, flag):
    target = tmp_path / "full" / "file"
    target.parent.mkdir()
    fill(monkeypatch, under(target.parent))
    assert main([*SEARCH, flag, str(target)]) == 2  # found full before the search
    one_line(capsys, flag, target)
    fill(monkeypatch, not_probe(under(target.parent)))  # full only when the file is written
    assert main([*SEARCH, flag, str(target)]) == 2
    one_line(capsys, target)
    assert left_in(target.parent) == []  # no empty CSV, no temporary


def test_profile_finds_a_full_disk_before_measuring_and_when_saving(tmp_path, capsys, monkeypatch):
    from flexoff.planner.hardware import resolve_hardware

    target = tmp_path / "full" / "profile.json"
    target.parent.mkdir()
    measured = []
    monkeypatch.setattr("flexoff.profiler.machine.profile_machine", lambda **kw: measured.append(1) or resolve_hardware("t4"))
    fill(monkeypatch, under(target.parent))
    assert main(["profile", "--quick", "--output", str(target)]) == 2
    one_line(capsys, "--output", target)
    assert measured == []
    fill(monkeypatch, not_probe(under(target.parent)))
    assert main(["profile", "--quick", "--output", str(target)]) == 2
    one_line(capsys, target)
    assert measured == [1] and left_in(target.parent) == []


def test_run_metrics_on_a_full_disk_keep_the_results(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    out, metrics = tmp_path / "out.jsonl", tmp_path / "full" / "metrics.json"
    metrics.parent.mkdir()
    fill(monkeypatch, not_probe(under(metrics.parent)))
    argv = ["run", "--quiet", "--num-prompts", "2", "--prompt-len", "4", "--gen-len", "2", "--output", str(out),
            "--metrics-json", str(metrics)]
    assert main(argv) == 2
    err = one_line(capsys, metrics, "kept in")
    assert Path(err.rsplit(" kept in ", 1)[1].strip()).parent == tmp_path
    assert len(out.read_text().splitlines()) == 2 and left_in(metrics.parent) == []


def full_cli(full: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    try:
        return subprocess.run([sys.executable, str(Path(__file__).with_name("full_disk.py")), str(full), *argv],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"flexoff {' '.join(argv)} did not end within 300 s on a full disk")


def test_the_command_line_on_a_full_disk(tiny_opt, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    source = write_jsonl(tmp_path / "in.jsonl", openai_lines(2))
    for argv in (batch(tiny_opt[0], source, full / "results.jsonl"),
                 ["profile", "--quick", "--output", str(full / "profile.json")]):
        done = full_cli(full, *argv)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and SPACE in done.stderr and "Traceback" not in done.stderr
        assert left_in(full) == []


def test_profile_whose_disk_fills_while_measuring(tmp_path, capsys, monkeypatch):
    import flexoff.profiler.machine as profiler

    disk = tmp_path / "disk"
    disk.mkdir()
    fill(monkeypatch, lambda path, fd: disk in path.parents and "disk-profile" in path.name)
    monkeypatch.setattr(profiler, "matmul_curve", lambda *args: pytest.fail("measured past the disk"))
    assert main(["profile", "--quick", "--device", "cpu", "--disk-dir", str(disk), "--output",
                 str(tmp_path / "p.json")]) == 2
    one_line(capsys, disk, "--disk-dir")
    assert left_in(disk) == [] and not (tmp_path / "p.json").exists()
