"""The results file: created with its first block, resumed, repaired after a crash, or refused."""

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from flexoff.errors import FlexoffError, OutputError
from flexoff.harness import store as store_module
from flexoff.harness.errors import JobMismatchError, ResultsFileError
from flexoff.harness.store import HEADER_KEY, ResultStore, id_key, job_path, make_header, read_records
from tests import processes

from .conftest import REPO

IDENTITY = {"model": {"name": "opt-125m"}, "input_sha256": "abc", "sampling": {"temperature": 0.0}}


def records(*ids):
    return [{"id": i, "text": f"out {i}"} for i in ids]


def test_file_appears_only_with_the_first_block(tmp_path):
    path = tmp_path / "out.jsonl"
    store = ResultStore.open(path, make_header("batch", IDENTITY))
    assert not path.exists()
    store.append(records(1, "1"))
    store.append(records(2))
    store.close()
    header, rows = read_records(path)
    assert header["identity"] == IDENTITY
    assert [r["id"] for r in rows] == [1, "1", 2]


def test_reopening_returns_what_is_done(tmp_path):
    path = tmp_path / "out.jsonl"
    header = make_header("batch", IDENTITY)
    with ResultStore.open(path, header) as store:
        store.append(records("a", "b"))
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        assert set(store.done) == {id_key("a"), id_key("b")}
        assert store.dropped_bytes == 0
        store.append(records("c"))
    assert [r["id"] for r in read_records(path)[1]] == ["a", "b", "c"]


@pytest.mark.parametrize("tail", [b'{"id": "c", "te', b'{"id": "c", "te\n', b"\x00\x00\x00\x00"])
def test_torn_last_line_is_dropped(tmp_path, tail):
    path = tmp_path / "out.jsonl"
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records("a", "b"))
    whole = path.read_bytes()
    path.write_bytes(whole + tail)
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        assert set(store.done) == {id_key("a"), id_key("b")}
        assert store.dropped_bytes == len(tail)
        store.append(records("c"))
    assert path.read_bytes().startswith(whole)
    assert [r["id"] for r in read_records(path)[1]] == ["a", "b", "c"]


def test_damage_before_the_last_line_is_refused_and_kept(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records("a", "b", "c"))
    lines = path.read_text().splitlines()
    lines[1] = "garbage"
    path.write_text("\n".join(lines) + "\n")
    before = path.read_bytes()
    with pytest.raises(ResultsFileError, match="line 2 is damaged"):
        ResultStore.open(path, make_header("batch", IDENTITY))
    assert path.read_bytes() == before


def test_repeated_id_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records("a", "b"))
    path.write_text(path.read_text() + json.dumps({"id": "a"}) + "\n")
    with pytest.raises(ResultsFileError, match="line 3 repeats id 'a' from line 1"):
        ResultStore.open(path, make_header("batch", IDENTITY))


def test_other_job_is_refused_with_what_differs_and_how_to_start_fresh(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records("a"))
    other = dict(IDENTITY, model={"name": "opt-1.3b"})
    with pytest.raises(JobMismatchError) as info:
        ResultStore.open(path, make_header("batch", other), fresh_hint="choose another --output")
    message = str(info.value)
    assert "its model differs" in message and "delete or move" in message and "--output" in message
    assert "\n" not in message
    with pytest.raises(JobMismatchError, match="not a 'bench' job"):
        ResultStore.open(path, make_header("bench", IDENTITY))


def test_foreign_file_is_refused_untouched(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text('{"id": 1, "text": "my own data"}\n')
    with pytest.raises(ResultsFileError, match="not a flexoff results file"):
        ResultStore.open(path, make_header("batch", IDENTITY))
    assert path.read_text() == '{"id": 1, "text": "my own data"}\n'
    assert issubclass(ResultsFileError, FlexoffError)


def test_the_job_file_beside_the_results_names_the_job(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records(1))
    job = json.loads(job_path(path).read_text())
    assert job["kind"] == "batch" and len(job["fingerprint"]) == 64 and job["identity"] == IDENTITY
    assert [json.loads(line) for line in path.read_text().splitlines()] == records(1)  # records only


def test_temporary_copy_of_a_killed_first_write_is_removed(tmp_path):
    path = tmp_path / "out.jsonl"
    stale = tmp_path / ".out.jsonl.abc123.tmp"
    stale.write_text('{"flexoff_job": {}}\n{"id": 1')
    other = tmp_path / ".other.jsonl.abc123.tmp"
    other.write_text("not ours")
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records(1))
    assert not stale.exists() and other.exists()


def test_a_second_job_is_refused_while_the_first_holds_the_file(tmp_path):
    path = tmp_path / "out.jsonl"
    first = ResultStore.open(path, make_header("batch", IDENTITY))
    first.append(records("a"))
    for identity in (IDENTITY, dict(IDENTITY, input_sha256="other")):  # refused before any job check
        with pytest.raises(ResultsFileError) as info:
            ResultStore.open(path, make_header("batch", identity), fresh_hint="choose another --output")
        message = str(info.value)
        assert f"{path} is being written by another flexoff job (process {os.getpid()})" in message
        assert "--output" in message and "\n" not in message
    first.append(records("b"))
    first.close()
    with ResultStore.open(path, make_header("batch", IDENTITY)) as again:
        assert set(again.done) == {id_key("a"), id_key("b")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.job.json"]  # no lock file left


def test_the_lock_goes_with_a_killed_holder(tmp_path):
    path = tmp_path / "out.jsonl"
    holder = processes.start(  # holds the file until it is killed: its stdin never ends
        [sys.executable, "-c", "import sys\nfrom flexoff.harness.store import ResultStore, make_header\n"
         f"store = ResultStore.open({str(path)!r}, make_header('batch', {IDENTITY!r}))\n"
         "print('held', flush=True)\nsys.stdin.read()\n"],
        env=dict(os.environ, PYTHONPATH=str(REPO)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert processes.read_line(holder, what="the file to be held").strip() == "held"
        with pytest.raises(ResultsFileError, match=f"another flexoff job \\(process {holder.pid}\\)"):
            ResultStore.open(path, make_header("batch", IDENTITY))
    finally:
        holder.send_signal(signal.SIGKILL)
        processes.wait(holder)
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records("a"))
    assert read_records(path)[1] == records("a")


@pytest.mark.parametrize("tail", [b"", b'{"id": "c", "te'])
def test_a_file_of_the_older_layout_resumes_and_moves_to_the_current_one(tmp_path, tail):
    path = tmp_path / "out.jsonl"
    header = make_header("batch", IDENTITY)
    old = dict(header, format=1)
    path.write_bytes(b"".join(json.dumps(line).encode() + b"\n" for line in [{HEADER_KEY: old}, *records("a", "b")])
                     + tail)
    assert read_records(path) == (old, records("a", "b"))
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        assert set(store.done) == {id_key("a"), id_key("b")} and store.dropped_bytes == len(tail)
        store.append(records("c"))
    assert [json.loads(line) for line in path.read_text().splitlines()] == records("a", "b", "c")
    assert json.loads(job_path(path).read_text()) == old
    with pytest.raises(JobMismatchError):  # the moved job still guards the file
        ResultStore.open(path, make_header("batch", dict(IDENTITY, input_sha256="other")))


def test_an_old_layout_file_of_another_job_is_refused_untouched(tmp_path):
    path = tmp_path / "out.jsonl"
    other = make_header("batch", dict(IDENTITY, input_sha256="other"))
    path.write_text(json.dumps({HEADER_KEY: other}) + "\n" + json.dumps({"id": "a"}) + "\n")
    before = path.read_bytes()
    with pytest.raises(JobMismatchError, match="its input_sha256 differs"):
        ResultStore.open(path, make_header("batch", IDENTITY))
    assert path.read_bytes() == before and not job_path(path).exists()


def test_a_job_file_without_records_is_replaced_by_the_next_job(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultStore.open(path, make_header("batch", dict(IDENTITY, input_sha256="other"))) as store:
        store.append(records("a"))
    path.write_bytes(b"")  # as if the first job died before its first block reached the disk
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records("b"))
    assert json.loads(job_path(path).read_text())["identity"] == IDENTITY
    assert read_records(path)[1] == records("b")


def test_a_full_disk_keeps_the_whole_records_and_says_so_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    store = ResultStore.open(path, make_header("batch", IDENTITY))
    store.append(records("a", "b"))

    def half_then_full(fd, payload):
        os.write(fd, payload[: len(payload) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_module, "_write_all", half_then_full)
    with pytest.raises(OutputError) as info:
        store.append(records("c", "d"))
    store.close()
    message = str(info.value)
    assert "\n" not in message and f"cannot write {path} (No space left on device)" in message
    assert "the 2 results before this block are kept in it" in message and "rerun" in message
    monkeypatch.undo()
    assert read_records(path)[1] == records("a", "b")
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        assert store.dropped_bytes == 0
        store.append(records("c", "d"))
    assert read_records(path)[1] == records("a", "b", "c", "d")


def test_records_are_strict_json_in_utf8(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append([{"id": "é", "text": "café ✓ 日本", "logprobs": [-0.5, float("nan"), float("-inf")]}])
    data = path.read_bytes()
    assert "café ✓ 日本".encode() in data and b"\\u" not in data
    assert b"NaN" not in data and b"Infinity" not in data
    assert json.loads(data) == {"id": "é", "text": "café ✓ 日本", "logprobs": [-0.5, None, None]}


def test_a_destination_that_cannot_hold_results_is_refused(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    (tmp_path / "file").write_text("x")
    for path, needle in [(tmp_path / "dir.jsonl", "is a directory"),
                         (tmp_path / "file" / "out.jsonl", "is a file, not a directory")]:
        with pytest.raises(OutputError, match=needle):
            ResultStore.open(path, make_header("batch", IDENTITY), flag="--output")
