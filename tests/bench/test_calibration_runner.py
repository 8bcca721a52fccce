"""A calibration run's time limit: a child past it is killed and reported as timed out, unless it
has written its results, when it has a grace period to exit (giving back pinned memory is slow).

The limits here are short, but no outcome depends on how fast the machine is: where results
count, they are there before the child starts (a loaded machine may take longer than the limit to
start Python), and a killed child would have slept far longer than any bound asserted."""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.calibration import runner  # noqa: E402
from tests import processes  # noqa: E402


SLEEP = 600  # a killed child's sleep: far past any bound below, however loaded the machine


def _child(tmp_path: Path, results: bool, sleep: float) -> list[str]:
    if results:
        (tmp_path / "done.json").write_text("{}")
    return [sys.executable, "-c", f"import time; time.sleep({sleep})"]


def test_a_child_that_wrote_its_results_may_exit_past_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "EXIT_GRACE_SECONDS", float(SLEEP))
    code, _, seconds = runner._run_child(_child(tmp_path, True, 1.5), tmp_path / "log", timeout=0.5,
                                         done=tmp_path / "done.json")
    assert code == 0 and seconds >= 1.5


def test_a_child_without_results_is_killed_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "EXIT_GRACE_SECONDS", float(SLEEP))
    code, _, seconds = runner._run_child(_child(tmp_path, False, SLEEP), tmp_path / "log", timeout=0.5,
                                         done=tmp_path / "done.json")
    assert code is None and seconds < SLEEP / 2


def test_the_grace_period_has_an_end(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "EXIT_GRACE_SECONDS", 0.5)
    code, _, seconds = runner._run_child(_child(tmp_path, True, SLEEP), tmp_path / "log", timeout=0.5,
                                         done=tmp_path / "done.json")
    assert code is None and seconds < SLEEP / 2


def test_a_run_ends_with_the_call_that_started_it(tmp_path):
    """A call stopped from outside (SIGTERM, as `timeout` sends) takes its run, in a session of its
    own, with it: a run left behind would hold its host memory into the next call."""
    pid_file = tmp_path / "run.pid"
    run = [sys.executable, "-c", f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); "
           f"time.sleep({SLEEP})"]
    call = processes.start([sys.executable, "-c", "import sys; from bench.calibration import runner; "
                            f"runner._run_child({run!r}, __import__('pathlib').Path({str(tmp_path / 'log')!r}), {SLEEP})"],
                           cwd=runner.ROOT)
    processes.wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the run to start", call)
    run_pid = int(pid_file.read_text())
    try:
        call.send_signal(signal.SIGTERM)
        assert processes.wait(call) == 128 + signal.SIGTERM
        # The run was this test's grandchild: gone means no such process (reaped by its parent).
        processes.wait_until(lambda: not _alive(run_pid), "the run to end with the call")
    finally:
        if _alive(run_pid):
            os.kill(run_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
