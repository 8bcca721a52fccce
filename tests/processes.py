"""Child processes in tests, with limits that only a hang reaches.

A loaded machine can make any child many times slower than it is on an idle one, so no test
waits a set time for a child, or for something a child does: it waits for the event itself, under
LIMIT_SECONDS. When a limit is hit, the test fails naming the command, what it was waiting for,
and the end of what the child printed, instead of with a bare ``TimeoutExpired``.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Far past any test's child on a loaded machine; overridable for a machine slower still.
LIMIT_SECONDS = float(os.environ.get("FLEXOFF_TEST_LIMIT_SECONDS", "1200"))
POLL_SECONDS = 0.01
TAIL_CHARS = 3000


def flexoff_env(**extra: str) -> dict:
    """The environment of a child running this tree's flexoff."""
    return dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", **extra)


def flexoff_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "flexoff", *map(str, args)]


def run(argv: Sequence, *, timeout: float = LIMIT_SECONDS, text: bool = True, env: dict | None = None,
        cwd=None, **popen) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True)``; past ``timeout`` the child and whatever it
    started are killed and the test fails, showing what they printed."""
    argv = [str(a) for a in argv]
    proc = start(argv, env=env, cwd=cwd, text=text, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
    out, err = communicate(proc, timeout=timeout)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_flexoff(*args: str, timeout: float = LIMIT_SECONDS, **popen) -> subprocess.CompletedProcess:
    """``python -m flexoff ARGS`` from the repository root, as a user would run it."""
    popen.setdefault("env", flexoff_env())
    popen.setdefault("cwd", REPO)
    return run(flexoff_argv(*args), timeout=timeout, **popen)


def start(argv: Sequence, **popen) -> subprocess.Popen:
    """``subprocess.Popen`` in a session of its own, so that a hang's kill takes its children too."""
    return subprocess.Popen([str(a) for a in argv], start_new_session=True, **popen)


def communicate(proc: subprocess.Popen, timeout: float = LIMIT_SECONDS, what: str = "the command to end"):
    """``proc.communicate()``, failing the test past ``timeout``."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        _fail(proc, what, timeout, expired.output, expired.stderr)
    except BaseException:
        kill(proc)
        raise


def wait(proc: subprocess.Popen, timeout: float = LIMIT_SECONDS, what: str = "the command to end") -> int:
    """``proc.wait()``, failing the test past ``timeout``."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _fail(proc, what, timeout)


def wait_until(condition: Callable[[], object], what: str, proc: subprocess.Popen | None = None,
               timeout: float = LIMIT_SECONDS):
    """Poll until ``condition()`` is true and return it. The test fails if ``proc`` ends first
    (the event can then never come) or past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = condition()  # it may have come just before the end
            if value:
                return value
            out, err = _output(proc)
            pytest.fail(f"{_command(proc)} ended with code {proc.returncode} before {what}"
                        f"{_tails(out, err)}", pytrace=False)
        if time.monotonic() > deadline:
            if proc is None:
                pytest.fail(f"waited {timeout:.0f} s for {what}", pytrace=False)
            _fail(proc, what, timeout)
        time.sleep(POLL_SECONDS)


def read_line(proc: subprocess.Popen, timeout: float = LIMIT_SECONDS, what: str = "its first line") -> str:
    """The next line of ``proc``'s stdout pipe, failing the test past ``timeout``."""
    line = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        _fail(proc, what, timeout)
    return line[0]


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL to ``proc``'s session (it and what it started), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone already, or not started by ``start``
        proc.kill()
    proc.wait()


def _fail(proc: subprocess.Popen, what: str, timeout: float, out=None, err=None):
    kill(proc)
    # A pipe read in part before is read whole now, the earlier part included.
    more_out, more_err = _output(proc)
    out, err = (out, err) if more_out is None and more_err is None else (more_out, more_err)
    pytest.fail(f"waited {timeout:.0f} s for {what}: killed {_command(proc)}{_tails(out, err)}", pytrace=False)


def _output(proc: subprocess.Popen):
    """What is left in the pipes of an ended ``proc``."""
    try:
        return proc.communicate(timeout=10)
    except (ValueError, OSError, subprocess.TimeoutExpired):  # pipes already read and closed
        return None, None


def _text(part) -> str:
    if part is None:
        return ""
    return part.decode(errors="replace") if isinstance(part, bytes) else part


def _tails(out, err) -> str:
    shown = ""
    for name, part in (("stdout", _text(out)), ("stderr", _text(err))):
        if part.strip():
            shown += f"\n--- its {name}, last {TAIL_CHARS} characters ---\n{part[-TAIL_CHARS:]}"
    return shown or "\n(it printed nothing, or its output was not captured)"


def _command(proc: subprocess.Popen) -> str:
    argv = proc.args if isinstance(proc.args, (list, tuple)) else [proc.args]
    return shlex.join(str(a) for a in argv)
