"""Atomic file writes: a reader sees the old file or the whole new one, never half of it."""

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write through a temporary file in the same folder, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def jsonl_objects(path: str | Path, text: str, error: type[Exception]) -> Iterator[tuple[int, str, dict]]:
    """Each non-blank line of a JSONL text as (line number, "PATH line N", object).

    A line that is not a JSON object raises ``error`` naming the file and line.
    """
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path} line {number}"
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            raise error(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise error(f"{where}: expected a JSON object, got {type(obj).__name__}")
        yield number, where, obj


def read_user_bytes(path: str | Path, what: str, error: type[Exception]) -> bytes:
    """The bytes of a file the user named; ``error`` says in one line what really went wrong
    (no such file, permission denied, a directory, ...), never "missing" for all of them."""
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        # strerror tells a missing file from a forbidden one or a directory ("permission denied").
        raise error(f"cannot read {what} {path}: {(exc.strerror or str(exc)).lower()}") from None


def read_user_text(path: str | Path, what: str, error: type[Exception]) -> str:
    """A UTF-8 text file the user named (see read_user_bytes)."""
    return decode_utf8(read_user_bytes(path, what, error), path, error)


def decode_utf8(data: bytes, path: str | Path, error: type[Exception]) -> str:
    """``data`` as UTF-8; bad UTF-8 is refused naming its line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise error(f"{path} line {line}: not valid UTF-8") from None


def nothing_at(path: str | Path) -> bool:
    """True only when no file is at ``path``; one that cannot be looked at (permission denied) is
    there, and reading it then says why it cannot be read."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False
