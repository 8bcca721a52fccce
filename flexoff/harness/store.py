"""An append-only JSONL results file that names its job and survives crashes.

Layout: the first line is a header, ``{"flexoff_job": {"kind", "fingerprint", "identity", ...}}``;
every later line is one JSON record with an ``"id"``. Records are appended a block at a time with
one ``write`` followed by flush and fsync, so after a crash the file holds every finished block
and at most one torn line at its end. Opening the file again:

- checks the header's fingerprint against the job being run, and refuses a different job;
- drops a torn last line (no newline, or not valid JSON) and truncates the file to the last
  whole record;
- refuses damage anywhere else, naming the line, rather than guess.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path

from ..fileio import write_text_atomic
from .errors import JobMismatchError, ResultsFileError

HEADER_KEY = "flexoff_job"
FORMAT_VERSION = 1


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


def _describe_difference(old: dict, new: dict) -> str:
    old_identity, new_identity = old.get("identity") or {}, new["identity"]
    if old.get("kind") != new["kind"]:
        return f"it is a {old.get('kind')!r} job, not a {new['kind']!r} job"
    changed = [key for key in sorted(set(old_identity) | set(new_identity))
               if old_identity.get(key) != new_identity.get(key)]
    if not changed:
        return "its fingerprint differs"
    return "its " + ", ".join(changed) + (" differs" if len(changed) == 1 else " differ")


class ResultStore:
    """Open with :meth:`open`; ``done`` maps id keys to the records already written."""

    def __init__(self, path: Path, header: dict, done: dict[str, dict], dropped_bytes: int, exists: bool):
        self.path = path
        self.header = header
        self.done = done
        self.dropped_bytes = dropped_bytes  # size of the torn tail removed on open, 0 if none
        # A new file is created with its first block, so a run that fails before finishing one
        # leaves nothing behind.
        self._handle = open(path, "ab") if exists else None

    @classmethod
    def open(cls, path: str | Path, header: dict, *, fresh_hint: str = "choose another output") -> "ResultStore":
        path = Path(path)
        if path.is_dir():
            raise ResultsFileError(f"{path} is a directory, not a results file")
        # A run killed while creating the file leaves its temporary copy (see write_text_atomic).
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        if not path.exists() or path.stat().st_size == 0:
            return cls(path, header, {}, 0, exists=False)
        done, keep_bytes, total_bytes = cls._read(path, header, fresh_hint)
        if keep_bytes < total_bytes:
            with open(path, "r+b") as handle:
                handle.truncate(keep_bytes)
                handle.flush()
                os.fsync(handle.fileno())
        return cls(path, header, done, total_bytes - keep_bytes, exists=True)

    @staticmethod
    def _read(path: Path, header: dict, fresh_hint: str) -> tuple[dict[str, dict], int, int]:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ResultsFileError(f"cannot read {path}: {exc.strerror or exc}") from None
        lines = data.split(b"\n")
        # split leaves a final "" when the file ends in a newline; anything else there is torn.
        complete, tail = lines[:-1], lines[-1]
        not_ours = (f"{path} is not a flexoff results file (its first line is not a job header); "
                    f"{fresh_hint}, or move it away")
        if not complete:
            raise ResultsFileError(not_ours)
        try:
            first = json.loads(complete[0])
        except ValueError:
            raise ResultsFileError(not_ours) from None
        if not isinstance(first, dict) or not isinstance(first.get(HEADER_KEY), dict):
            raise ResultsFileError(not_ours)
        old = first[HEADER_KEY]
        if old.get("fingerprint") != header["fingerprint"] or old.get("kind") != header["kind"]:
            raise JobMismatchError(
                f"{path} holds results of a different job ({_describe_difference(old, header)}); "
                f"to start fresh, delete or move {path}, or {fresh_hint}"
            )
        done: dict[str, dict] = {}
        first_line_of: dict[str, int] = {}
        keep = len(complete[0]) + 1
        for number, raw in enumerate(complete[1:], start=2):
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if not isinstance(record, dict) or "id" not in record:
                if number == len(complete) and not tail:
                    break  # a last line that did not finish cleanly: torn, dropped below
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
        return done, keep, len(data)

    def append(self, records: list[dict]) -> None:
        """Write whole records durably: one write, then flush and fsync."""
        if not records:
            return
        payload = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)
        if self._handle is None:
            header = json.dumps({HEADER_KEY: self.header}) + "\n"
            write_text_atomic(self.path, header + payload.decode())
            self._handle = open(self.path, "ab")
        else:
            self._handle.write(payload)
            self._handle.flush()
            os.fsync(self._handle.fileno())
        for record in records:
            self.done[id_key(record["id"])] = record

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> "ResultStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_records(path: str | Path) -> tuple[dict, list[dict]]:
    """The header and the records of a results file, for tools that read results back."""
    lines = Path(path).read_text().splitlines()
    try:
        header = json.loads(lines[0]).get(HEADER_KEY) if lines else None
    except (ValueError, AttributeError):
        header = None
    if header is None:
        raise ResultsFileError(f"{path} is not a flexoff results file")
    return header, [json.loads(line) for line in lines[1:] if line.strip()]
