"""The tests' child processes: a hang fails the test naming the command and what it printed, and
a wait for an event fails as soon as the child ends without it."""

import subprocess
import sys

import pytest

from tests import processes

# Says it started, on both pipes, then leaves a mark, then hangs until killed.
HANGS = ("import pathlib, signal, sys; print('started out', flush=True); print('started err', file=sys.stderr, "
         "flush=True); pathlib.Path(sys.argv[1]).touch(); signal.pause()")


def test_a_child_that_ends_gives_its_code_and_output():
    done = processes.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_a_hung_child_fails_the_test_naming_it_and_what_it_printed(tmp_path):
    mark = tmp_path / "started"
    child = processes.start([sys.executable, "-c", HANGS, str(mark)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    processes.wait_until(mark.exists, "the child to start", child)
    with pytest.raises(pytest.fail.Exception) as failed:
        processes.communicate(child, timeout=0.1, what="the child to end")
    message = str(failed.value)
    assert message.startswith(f"waited 0 s for the child to end: killed {sys.executable} -c ")
    assert message.endswith("stdout, last 3000 characters ---\nstarted out\n\n"
                            "--- its stderr, last 3000 characters ---\nstarted err\n")
    assert child.returncode == -9  # killed, and reaped


def test_a_wait_for_an_event_ends_with_the_child(tmp_path):
    child = processes.start([sys.executable, "-c", "import sys; print('gave up', file=sys.stderr); sys.exit(1)"],
                            stderr=subprocess.PIPE, text=True)
    with pytest.raises(pytest.fail.Exception) as failed:
        processes.wait_until(lambda: (tmp_path / "never").exists(), "the file to appear", child)
    assert "ended with code 1 before the file to appear" in str(failed.value)
    assert "gave up" in str(failed.value)
