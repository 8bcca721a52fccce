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
