"""An append-only JSONL results file, held by one job at a time, that survives crashes.

Layout: every line of ``results.jsonl`` is one record (see :mod:`flexoff.records`), so pandas
and jq read it as is. The job it belongs to (kind, fingerprint, identity) is in
``results.jsonl.job.json`` beside it, written atomically before the first record. Files of the
older layout, whose first line is ``{"flexoff_job": {...}}``, are moved to this one when resumed.

Records are appended a block at a time with one ``write`` followed by flush and fsync, so after a
crash the file holds every finished block and at most one torn line at its end. Opening the file:

- takes an OS lock (``flock``) on ``.results.jsonl.lock``, so a second job on the same file is
  refused; the OS drops the lock when its holder exits, even on ``kill -9``;
- checks the job's fingerprint, and refuses a different job;
- drops a torn last line (no newline, or not valid JSON) and truncates the file to the last
  whole record;
- refuses damage anywhere else, naming the line, rather than guess.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path

from ..errors import OutputError
from ..fileio import check_destination, json_text, write_all, write_text_atomic
from ..records import record_line
from .errors import JobMismatchError, ResultsFileError

HEADER_KEY = "flexoff_job"  # the first line of the older layout
FORMAT_VERSION = 2


def id_key(value) -> str:
    """A record id as a dictionary key: 1 and "1" stay distinct."""
    return json.dumps(value)


def fingerprint(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def make_header(kind: str, identity: dict) -> dict:
    return {
        "format": FORMAT_VERSION, "kind": kind, "fingerprint": fingerprint(identity), "identity": identity,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def job_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".job.json")


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def _describe_difference(old: dict, new: dict) -> str:
    old_identity, new_identity = old.get("identity") or {}, new["identity"]
    if old.get("kind") != new["kind"]:
        return f"it is a {old.get('kind')!r} job, not a {new['kind']!r} job"
    changed = [key for key in sorted(set(old_identity) | set(new_identity))
               if old_identity.get(key) != new_identity.get(key)]
    if not changed:
        return "its fingerprint differs"
    return "its " + ", ".join(changed) + (" differs" if len(changed) == 1 else " differ")


class _Lock:
    """An exclusive ``flock`` on a lock file beside the results; the file goes when released."""

    def __init__(self, path: Path, results: Path, fresh_hint: str):
        while True:
            fd = _open_lock(path, results, fresh_hint)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip()
                os.close(fd)
                who = f" (process {holder})" if holder.isdigit() else ""
                raise ResultsFileError(f"{results} is being written by another flexoff job{who}; wait for it "
                                       f"to finish, or {fresh_hint}") from None
            except OSError as exc:  # a file system without locks
                os.close(fd)
                raise ResultsFileError(f"cannot lock {path} for {results} ({exc.strerror or exc})") from None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else its holder removed it just before we locked it: take the new one
                break
            os.close(fd)
        self.path, self.fd = path, fd
        try:
            os.ftruncate(fd, 0)
            write_all(fd, str(os.getpid()).encode())
        except OSError as exc:  # a full disk: the lock goes, and the results file was not touched
            self.release()
            raise OutputError(f"cannot write {path} ({exc.strerror or exc}); {results} is as it was: rerun the "
                              "same command once there is room") from None

    def release(self) -> None:
        if self.fd is not None:
            # Removed while still held, so nobody can lock this file after us and miss a later holder.
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def _open_lock(path: Path, results: Path, fresh_hint: str) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except IsADirectoryError:
        raise ResultsFileError(f"cannot lock {results}: its lock file {path} is a directory; move it away, "
                               f"or {fresh_hint}") from None
    except OSError as exc:
        raise ResultsFileError(f"cannot lock {results}: cannot create {path} ({exc.strerror or exc})") from None


class ResultStore:
    """Open with :meth:`open`; ``done`` maps id keys to the records already written."""

    def __init__(self, path: Path, header: dict, done: dict[str, dict], dropped_bytes: int, lock: _Lock):
        self.path = path
        self.header = header
        self.done = done
        self.dropped_bytes = dropped_bytes  # size of the torn tail removed on open, 0 if none
        self._lock = lock
        # The job file is written with the first block, so a run that fails before finishing one
        # leaves nothing behind.
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND) if done else None
        self._made_file = not path.exists()  # what a first block that fails removes again

    @classmethod
    def open(cls, path: str | Path, header: dict, *, fresh_hint: str = "choose another output",
             flag: str = "results file") -> "ResultStore":
        """``flag`` names the destination in errors (e.g. "--output")."""
        path = check_destination(path, flag)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create {path.parent} ({exc.strerror or exc})") from None
        lock = _Lock(_lock_path(path), path, fresh_hint)
        try:
            # A run killed while writing the job file or moving an old file leaves a temporary copy.
            for stale in path.parent.glob(f".{path.name}.*.tmp"):
                stale.unlink(missing_ok=True)
            done, dropped = cls._resume(path, header, fresh_hint)
            return cls(path, header, done, dropped, lock)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def _resume(cls, path: Path, header: dict, fresh_hint: str) -> tuple[dict[str, dict], int]:
        """The records already in ``path`` for this job, after repairing a torn end."""
        data = _read_bytes(path) if path.exists() else b""
        old_header, start = _old_header(data)
        job = _read_job(path) if old_header is None else old_header
        if not data[start:]:
            return {}, 0  # no records yet: a job file alone is only a plan, and this run replaces it
        if job is None:
            raise ResultsFileError(f"{path} is not a flexoff results file (there is no {job_path(path).name} "
                                   f"beside it); {fresh_hint}, or move it away")
        if job.get("fingerprint") != header["fingerprint"] or job.get("kind") != header["kind"]:
            raise JobMismatchError(
                f"{path} holds results of a different job ({_describe_difference(job, header)}); "
                f"to start fresh, delete or move {path}, or {fresh_hint}"
            )
        done, keep = _parse_records(path, data, start)
        if "policy" in job:  # the policy its results were generated with, which this run must not contradict
            header.setdefault("policy", job["policy"])
        kept = f"its {len(done)} results are as they were: rerun the same command once there is room"
        if old_header is not None:  # move to the current layout: job file first, then the bare records
            # Until the second write, the file still starts with its job: a failure between them is resumed again.
            _write_job(job_path(path), old_header, kept)
            _write_or_say(path, lambda: write_text_atomic(path, data[start:keep].decode("utf-8")), kept)
        elif keep < len(data):
            def cut() -> None:
                with open(path, "r+b") as handle:
                    handle.truncate(keep)
                    handle.flush()
                    os.fsync(handle.fileno())

            _write_or_say(path, cut, kept)
        return done, len(data) - keep

    def record_policy(self, policy: dict) -> None:
        """Keep the policy this run uses in the job file (outside the fingerprint: a job may resume
        under another lossless policy, and the file then names the latest). Its compression must be
        the earlier run's, since compression changes the tokens."""
        earlier = self.header.get("policy")
        if self.done and earlier is not None and _lossy_parts(earlier) != _lossy_parts(policy):
            raise JobMismatchError(
                f"{self.path} holds results generated with {_describe_lossy(earlier)}, but this run has "
                f"{_describe_lossy(policy)}; compressed and lossless tokens differ, so they do not mix: rerun "
                "with the compression of the first run, or choose another --output")
        if earlier == policy:
            return  # a resumed job under the same policy: nothing to rewrite (on a full disk, nothing to fail)
        self.header["policy"] = policy
        if self._fd is not None:  # resumed: the job file is already there
            _write_job(job_path(self.path), self.header,
                       f"the {len(self.done)} results in {self.path} are kept: rerun the same command to finish")

    def append(self, records: list[dict]) -> None:
        """Write whole records durably: one write, then fsync. If the write fails (a full disk), the
        file is cut back to the records before it and the error says so in one line."""
        if not records:
            return
        payload = "".join(record_line(r) + "\n" for r in records).encode("utf-8")
        first = self._fd is None
        failing = job_path(self.path) if first else self.path  # the file a failure names
        try:
            if first:
                write_text_atomic(failing, json_text(self.header, indent=2) + "\n")
                failing = self.path
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o644)
            size = os.fstat(self._fd).st_size
            try:
                _write_all(self._fd, payload)
                os.fsync(self._fd)
            except OSError:
                os.ftruncate(self._fd, size)
                raise
        except OSError as exc:
            if first:  # nothing of this job was kept, so nothing of it stays
                self._unstart(wrote_job=failing == self.path)
                kept = "no results were written: rerun the same command once there is room"
            else:
                kept = (f"the {len(self.done)} results before this block are kept in it: rerun the same command "
                        "to finish")
            raise OutputError(f"cannot write {failing} ({exc.strerror or exc}); {kept}") from None
        for record in records:
            self.done[id_key(record["id"])] = record

    def _unstart(self, wrote_job: bool) -> None:
        """Undo a first block's files: the job file it wrote, and the results file if it made it."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if wrote_job:
            job_path(self.path).unlink(missing_ok=True)
        if self._made_file:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._lock.release()

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PeerStore:
    """A parallel job's view of the results file rank 0 holds (ResultStore's interface): the ids
    it held when opened, and those this run added since; it writes nothing and holds no lock."""

    def __init__(self, path: str | Path, done_ids: set[str]):
        self.path = Path(path)
        self.done: dict[str, dict | None] = dict.fromkeys(done_ids)
        self.dropped_bytes = 0

    def record_policy(self, policy: dict) -> None:
        pass

    def append(self, records: list[dict]) -> None:
        for record in records:
            self.done[id_key(record["id"])] = record

    def close(self) -> None:
        pass


def _write_or_say(path: Path, write, kept: str) -> None:
    """Run ``write``, which writes ``path``; a failure (a full disk) is one line naming it and what is kept."""
    try:
        write()
    except OSError as exc:
        raise OutputError(f"cannot write {path} ({exc.strerror or exc}); {kept}") from None


def _write_job(path: Path, header: dict, kept: str) -> None:
    _write_or_say(path, lambda: write_text_atomic(path, json_text(header, indent=2) + "\n"), kept)


def _write_all(fd: int, payload: bytes) -> None:
    write_all(fd, payload)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ResultsFileError(f"cannot read {path}: {exc.strerror or exc}") from None


def _old_header(data: bytes) -> tuple[dict | None, int]:
    """The job header of the older layout and the offset of the first record; (None, 0) if none."""
    first, newline, _ = data.partition(b"\n")
    if not newline:
        return None, 0
    try:
        value = json.loads(first)
    except ValueError:
        return None, 0
    if isinstance(value, dict) and isinstance(value.get(HEADER_KEY), dict):
        return value[HEADER_KEY], len(first) + 1
    return None, 0


def _read_job(path: Path) -> dict | None:
    job = job_path(path)
    if not job.exists():
        return None
    try:
        value = json.loads(job.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ResultsFileError(f"cannot read {job}: {getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(value, dict):
        raise ResultsFileError(f"{job} is not a flexoff job file")
    return value


def _parse_records(path: Path, data: bytes, start: int) -> tuple[dict[str, dict], int]:
    """The records from byte ``start`` on, and the offset just after the last whole one."""
    lines = data[start:].split(b"\n")
    # split leaves a final "" when the data ends in a newline; anything else there is torn.
    complete, tail = lines[:-1], lines[-1]
    first_number = 2 if start else 1
    done: dict[str, dict] = {}
    first_line_of: dict[str, int] = {}
    keep = start
    for number, raw in enumerate(complete, start=first_number):
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "id" not in record:
            if number == first_number + len(complete) - 1 and not tail:
                break  # a last line that did not finish cleanly: torn, dropped by the caller
            raise ResultsFileError(
                f"{path} line {number} is damaged (not a JSON record with an id); "
                f"repair or remove that line, then rerun"
            )
        key = id_key(record["id"])
        if key in done:
            raise ResultsFileError(
                f"{path} line {number} repeats id {record['id']!r} from line {first_line_of[key]}; "
                "remove one of them, then rerun"
            )
        done[key] = record
        first_line_of[key] = number
        keep += len(raw) + 1
    return done, keep


def read_records(path: str | Path) -> tuple[dict, list[dict]]:
    """The job and the records of a results file (either layout), for tools that read results back.

    pandas and jq read the current layout directly: ``pandas.read_json(path, lines=True)``."""
    path = Path(path)
    data = _read_bytes(path)
    header, start = _old_header(data)
    header = header or _read_job(path)
    if header is None:
        raise ResultsFileError(f"{path} is not a flexoff results file")
    # Whole lines only: a job still running (or killed) may have left a torn last one.
    return header, [json.loads(line) for line in data[start:].split(b"\n")[:-1] if line.strip()]


def _lossy_parts(policy: dict) -> tuple:
    return policy.get("compress_weight"), policy.get("compress_cache")


def _describe_lossy(policy: dict) -> str:
    """'weights 4-bit and a lossless cache', as the run summary names compression."""
    weight, cache = _lossy_parts(policy)
    parts = [f"weights {weight['bits']}-bit" if weight else "lossless weights",
             f"cache {cache['bits']}-bit" if cache else "a lossless cache"]
    return " and ".join(parts)
