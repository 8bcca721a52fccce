"""A calibration run's time limit: a child past it is killed and reported as timed out, unless it
has written its results, when it has a grace period to exit (giving back pinned memory is slow)."""

import sys
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
