"""The results file: created with its first block, resumed, repaired after a crash, or refused."""

import json

import pytest

from flexoff.errors import FlexoffError
from flexoff.harness.errors import JobMismatchError, ResultsFileError
from flexoff.harness.store import HEADER_KEY, ResultStore, id_key, make_header, read_records

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
    lines[2] = "garbage"
    path.write_text("\n".join(lines) + "\n")
    before = path.read_bytes()
    with pytest.raises(ResultsFileError, match="line 3 is damaged"):
        ResultStore.open(path, make_header("batch", IDENTITY))
    assert path.read_bytes() == before


def test_repeated_id_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records("a", "b"))
    path.write_text(path.read_text() + json.dumps({"id": "a"}) + "\n")
    with pytest.raises(ResultsFileError, match="line 4 repeats id 'a' from line 2"):
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


def test_header_names_the_job(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records(1))
    first = json.loads(path.read_text().splitlines()[0])[HEADER_KEY]
    assert first["kind"] == "batch" and len(first["fingerprint"]) == 64


def test_temporary_copy_of_a_killed_first_write_is_removed(tmp_path):
    path = tmp_path / "out.jsonl"
    stale = tmp_path / ".out.jsonl.abc123.tmp"
    stale.write_text('{"flexoff_job": {}}\n{"id": 1')
    other = tmp_path / ".other.jsonl.abc123.tmp"
    other.write_text("not ours")
    with ResultStore.open(path, make_header("batch", IDENTITY)) as store:
        store.append(records(1))
    assert not stale.exists() and other.exists()
