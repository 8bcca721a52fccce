"""Writing files safely: atomic writes, strict JSON, destinations checked before any work, and a
place to keep results when their destination fails at the end."""

import errno
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import OutputError, PolicyError


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write UTF-8 through a temporary file in the same folder, then rename it into place, so a
    reader sees the old file or the whole new one, never half of it."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """As write_text_atomic, for bytes (an image). A failed write (a full disk) leaves no
    temporary file and the old file, if any, as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``, in as many writes as the system takes. Every file flexoff
    writes goes through here, so a full disk is met in one place."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written == 0:  # a file system that takes nothing and reports no error: never retry forever
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


def _finite(value):
    """``value`` with every non-finite float replaced by None (JSON has no NaN or infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def json_text(value, *, indent: int | None = None) -> str:
    """Strict JSON (a non-finite number becomes null, never a bare NaN), with UTF-8 left as is."""
    return json.dumps(_finite(value), ensure_ascii=False, allow_nan=False, indent=indent)


def check_destination(path: str | Path, flag: str) -> Path:
    """Refuse, before any work, a file destination that cannot be written: a directory, a path under
    a file, a folder without write permission, or a read-only file. Missing folders are fine (they
    are made when the file is written)."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{flag} {path} is a directory; give a file path")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{flag} {path} is read-only")
    check_folder(path.parent, flag, path)
    return path


def check_folder(folder: str | Path, flag: str, target: str | Path | None = None) -> Path:
    """Refuse a folder that is a file, lies under a file, or cannot be written into."""
    folder = Path(folder)
    target = folder if target is None else target
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"{flag} {target}: {existing} is a file, not a directory")
    probe = None
    try:  # a real probe: permissions, read-only mounts, root and a full disk all answer the same way
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".flexoff-probe-")
        try:
            write_all(fd, b"\n")  # an empty file takes no space: a byte finds a full disk
        finally:
            os.close(fd)
    except OSError as exc:
        raise OutputError(f"{flag} {target}: cannot write in {existing} ({exc.strerror or exc})") from None
    finally:
        if probe is not None:
            Path(probe).unlink(missing_ok=True)
    return folder


def write_or_keep(path: str | Path, text: str, what: str) -> str | None:
    """Write ``text`` to ``path`` atomically; if that fails, keep it in a new file elsewhere (the
    temporary folder, else the current one). Returns None, or one line saying what failed and
    where ``what`` (e.g. "the 16 results") now is."""
    path = Path(path)
    try:
        write_text_atomic(path, text)
        return None
    except OSError as exc:
        problem = f"cannot write {path} ({exc.strerror or exc})"
    for folder in (tempfile.gettempdir(), os.getcwd()):
        kept = None
        try:
            fd, kept = tempfile.mkstemp(dir=folder, prefix=f"flexoff-{path.stem}-", suffix=path.suffix)
            try:
                write_all(fd, text.encode("utf-8"))
            finally:
                os.close(fd)
            return f"{problem}; {what}: kept in {kept}"
        except OSError as exc:
            last = exc.strerror or str(exc)
            if kept is not None:  # half a copy is no copy
                Path(kept).unlink(missing_ok=True)
    return f"{problem}, and {what} could not be kept elsewhere either ({last})"


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


def read_user_json(path: str | Path, what: str, error: type[Exception]):
    """A JSON file the user named (a policy, a profile): its value, or ``error`` saying why not."""
    text = read_user_text(path, what, error)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise error(f"{what} {path} is not valid JSON: {exc}") from None


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


def offload_root(given: str | os.PathLike | None) -> str:
    """The folder the disk tier goes in: ``given``, else $FLEXOFF_OFFLOAD_DIR, else the system's
    temporary folder ($TMPDIR, else /tmp), so that a policy with data on disk runs without naming
    one. flexoff makes a private folder inside it and removes it on exit."""
    return os.fspath(given) if given else os.environ.get("FLEXOFF_OFFLOAD_DIR") or tempfile.gettempdir()


def check_offload_dir(path: str | os.PathLike | None) -> None:
    """Refuse an offload directory that is a file: it can never hold the disk tier, whatever the
    policy, so it is named now rather than once a plan puts data on disk."""
    if path is not None and os.path.isfile(path):
        raise PolicyError(f"offload directory {os.fspath(path)} is a file; give a directory (flexoff makes a "
                          "private folder inside it, created if needed)")


def usable_offload_dir(path: str | Path) -> Path:
    """The offload directory, created if needed; refused unless it can be written."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PolicyError(f"cannot use offload directory {path}: {exc.strerror or exc}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PolicyError(f"cannot use offload directory {path}: it is not writable")
    return directory
