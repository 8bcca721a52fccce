"""Private folders in the offload directory, each marked with its owner, so that a later run removes
the folders of owners that died without cleaning up (a SIGKILL or an OOM kill skips every finalizer).

An owner is a host name, a process id and that process's start time: process ids are reused, so
the id alone could make a dead owner look alive, or a live one dead.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import psutil

PREFIX = "flexoff-"
OWNER_FILE = ".owner.json"
_PARTIAL = OWNER_FILE + ".partial"
_START_TOLERANCE = 1.0  # seconds: start times are read from the kernel's clock ticks, not exactly


def make_private_folder(base: Path) -> Path:
    """A new mode-0700 folder in ``base``, marked as this process's, after removing dead owners'."""
    remove_dead_folders(base)
    # The name carries the host and process id too: a process killed before its mark is written
    # leaves a folder that still names its owner.
    directory = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{_host_tag()}-{os.getpid()}-", dir=base))
    # A folder is removed only when a whole mark, or else its name, names a dead owner, so another
    # process cleaning up cannot take this one between its creation and its mark. The mark is written aside and renamed
    # into place; one whose writer was killed before the rename still names it, and counts.
    partial = directory / _PARTIAL
    try:
        partial.write_text(json.dumps(owner_of(os.getpid())))
        os.replace(partial, directory / OWNER_FILE)
    except OSError:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def owner_of(pid: int) -> dict:
    return {"host": socket.gethostname(), "pid": pid, "started": psutil.Process(pid).create_time()}


def owner_is_dead(owner: dict) -> bool:
    """Whether ``owner`` has certainly exited: it ran on this host, and no live process has its id
    and start time. Anything unreadable or from another host counts as alive."""
    pid, started = owner.get("pid"), owner.get("started")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) \
            or pid <= 0 or not isinstance(started, (int, float)) or isinstance(started, bool):
        return False
    return _exited(pid, started)


def _exited(pid: int, started: float | None) -> bool:
    """Whether process ``pid`` (started at ``started``, where known) has exited; unreadable counts as alive.
    Without a start time, a live process with the id may be another one, and counts as alive."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped by its parent
            return True
        # the id now names another process
        return started is not None and abs(process.create_time() - started) > _START_TOLERANCE
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, OSError, ValueError, OverflowError):  # an id too large to be one
        return False


def remove_dead_folders(base: Path) -> list[Path]:
    """Remove the folders in ``base`` that are named as ours and marked by an owner that is dead on
    this host; leave everything else. Returns the folders removed."""
    try:
        entries = list(base.iterdir())
    except OSError:
        return []
    removed = []
    for entry in entries:
        if not entry.name.startswith(PREFIX) or entry.is_symlink() or not entry.is_dir():
            continue
        owner = _read_owner(entry)
        dead = owner_is_dead(owner) if owner is not None else _unmarked_owner_is_dead(entry.name)
        if dead:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def _unmarked_owner_is_dead(name: str) -> bool:
    """Whether the process a folder's name gives as its maker, on this host, has exited. Without the
    mark's start time a live process with that id may be another one; such a folder is kept."""
    match = re.fullmatch(re.escape(PREFIX) + r"([0-9a-f]{8})-([0-9]+)-[^/]+", name)
    return match is not None and match.group(1) == _host_tag() and _exited(int(match.group(2)), None)


def _read_owner(folder: Path) -> dict | None:
    """The owner a folder's mark names; None when it has no whole mark (one may be being written)."""
    for name in (OWNER_FILE, _PARTIAL):
        try:
            owner = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(owner, dict):
            return owner
    return None
