"""A full disk, faked at the one call every file write of flexoff goes through (``os.write``):
writes into the files ``full(path, fd)`` picks fail with ENOSPC, as they would on a full disk.

Run as a script, it runs ``flexoff ARGS`` with every write under the folder FULL failing:
``python full_disk.py FULL ARGS...``.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path


def written_path(fd: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None


REAL_WRITE = os.write


def enospc_writes(full, original=REAL_WRITE) -> callable:
    """An ``os.write`` that fails with ENOSPC where ``full(path, fd)`` is true."""

    def write(fd, data):
        path = written_path(fd)
        if path is not None and full(path, fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(fd, data)

    return write


def under(folder: Path):
    folder = Path(os.path.realpath(folder))
    return lambda path, fd: folder in path.parents


if __name__ == "__main__":
    os.write = enospc_writes(under(Path(sys.argv[1])))
    from flexoff.commands.main import main

    sys.exit(main(sys.argv[2:]))
