"""A calibration run's time limit: a child past it is killed and reported as timed out, unless it
has written its results, when it has a grace period to exit (giving back pinned memory is slow)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.calibration import runner  # noqa: E402


def _child(tmp_path: Path, write_first: bool, sleep: float) -> list[str]:
    done = tmp_path / "done.json"
    code = (f"import pathlib, time; p = pathlib.Path({str(done)!r}); "
            + ("p.write_text('{}'); " if write_first else "")
            + f"time.sleep({sleep})")
    return [sys.executable, "-c", code]


def test_a_child_that_wrote_its_results_may_exit_past_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "EXIT_GRACE_SECONDS", 5.0)
    code, _, seconds = runner._run_child(_child(tmp_path, True, 1.5), tmp_path / "log", timeout=0.5,
                                         done=tmp_path / "done.json")
    assert code == 0 and seconds >= 1.5


def test_a_child_without_results_is_killed_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "EXIT_GRACE_SECONDS", 5.0)
    code, _, seconds = runner._run_child(_child(tmp_path, False, 30), tmp_path / "log", timeout=0.5,
                                         done=tmp_path / "done.json")
    assert code is None and seconds < 5


def test_the_grace_period_has_an_end(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "EXIT_GRACE_SECONDS", 0.5)
    code, _, seconds = runner._run_child(_child(tmp_path, True, 30), tmp_path / "log", timeout=0.5,
                                         done=tmp_path / "done.json")
    assert code is None and seconds < 5


def test_a_run_ends_with_the_call_that_started_it(tmp_path):
    """A call stopped from outside (SIGTERM, as `timeout` sends) takes its run, in a session of its
    own, with it: a run left behind would hold its host memory into the next call."""
    pid_file = tmp_path / "run.pid"
    run = [sys.executable, "-c", f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); "
           "time.sleep(60)"]
    call = subprocess.Popen([sys.executable, "-c", "import sys; from bench.calibration import runner; "
                             f"runner._run_child({run!r}, __import__('pathlib').Path({str(tmp_path / 'log')!r}), 60)"],
                            cwd=runner.ROOT)
    deadline = time.time() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline and call.poll() is None, "the run did not start"
        time.sleep(0.05)
    run_pid = int(pid_file.read_text())
    try:
        call.send_signal(signal.SIGTERM)
        assert call.wait(timeout=30) == 128 + signal.SIGTERM
        # The run was this test's grandchild: gone means no such process (reaped by its parent).
        deadline = time.time() + 10
        while _alive(run_pid):
            assert time.time() < deadline, "the run outlived the call"
            time.sleep(0.05)
    finally:
        if _alive(run_pid):
            os.kill(run_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
