"""Offload folders left by a process killed outright are removed by the next run in the same
offload directory; live processes' folders, other hosts' and anything not flexoff's are kept."""

import json
import os
import signal
import subprocess
import sys

import psutil

from flexoff.runtime.offload_dir import OWNER_FILE, PREFIX, _host_tag, owner_of
from flexoff.runtime.tiers import DiskTier
from tests import processes

DEAD_PID = 2 ** 22 + 7  # above Linux's largest pid_max: no process ever has it
# Makes a disk tier holding data, prints its folder, then waits to be killed: its stdin never ends.
CHILD = """
import sys, torch
from flexoff.runtime.tiers import DiskTier
tier = DiskTier(sys.argv[1])
tier.allocate("weights", 1 << 20).write(torch.ones(1 << 18))
print(tier.directory, flush=True)
sys.stdin.read()
"""


def start_child(base):
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = processes.start([sys.executable, "-c", CHILD, str(base)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    line = processes.read_line(child, what="its offload folder").strip()
    assert line, "the child made no offload folder"
    return child, line


def marked_folder(base, name, owner):
    folder = base / name
    folder.mkdir()
    (folder / "data").write_bytes(b"x" * 4096)
    if owner is not None:
        (folder / OWNER_FILE).write_text(json.dumps(owner))
    return folder


def test_a_killed_process_folder_is_removed_by_the_next_start(tmp_path):
    base = tmp_path / "offload"
    killed, killed_dir = start_child(base)
    live, live_dir = start_child(base)
    try:
        assert os.path.getsize(os.path.join(killed_dir, "weights")) == 1 << 20
        killed.send_signal(signal.SIGKILL)
        processes.wait(killed)
        me = owner_of(os.getpid())
        elsewhere = marked_folder(base, PREFIX + "other-host", {**me, "host": "another-host", "pid": DEAD_PID})
        reused = marked_folder(base, PREFIX + "reused-pid", {**me, "started": me["started"] - 1000})
        unmarked = marked_folder(base, PREFIX + "unmarked", None)
        not_ours = marked_folder(base, "something-else", {**me, "pid": DEAD_PID})
        # Killed between writing its mark and renaming it into place:
        unrenamed = marked_folder(base, PREFIX + "unrenamed", None)
        (unrenamed / (OWNER_FILE + ".partial")).write_text(json.dumps({**me, "pid": DEAD_PID}))
        # Killed between making its folder and writing its mark: only the name tells the owner.
        here = f"{PREFIX}{_host_tag()}"
        unmarked_dead = marked_folder(base, f"{here}-{DEAD_PID}-abc123", None)
        unmarked_live = marked_folder(base, f"{here}-{os.getpid()}-abc123", None)
        unmarked_elsewhere = marked_folder(base, f"{PREFIX}00000000-{DEAD_PID}-abc123", None)
        half_written = marked_folder(base, PREFIX + "half-written", None)
        (half_written / (OWNER_FILE + ".partial")).write_text(json.dumps({**me, "pid": DEAD_PID})[:20])
        tier = DiskTier(base)
        try:
            kept = sorted(p.name for p in base.iterdir())
            assert os.path.basename(killed_dir) not in kept
            assert not reused.exists()  # the id now belongs to another process (this one)
            assert not unrenamed.exists()
            assert not unmarked_dead.exists()
            for folder in (live_dir, elsewhere, unmarked, half_written, not_ours, tier.directory, unmarked_live,
                           unmarked_elsewhere):
                assert os.path.isdir(folder), (folder, kept)
            assert os.path.getsize(os.path.join(live_dir, "weights")) == 1 << 20
        finally:
            tier.close()
        assert not tier.directory.exists()
    finally:
        for child in (killed, live):
            if child.poll() is None:
                child.kill()
            processes.wait(child)


def test_a_folder_is_marked_before_anyone_can_see_it_unmarked(tmp_path):
    """Its mark appears by a rename, whole; the owner is this process, alive."""
    tier = DiskTier(tmp_path)
    try:
        owner = json.loads((tier.directory / OWNER_FILE).read_text())
        assert owner["pid"] == os.getpid() and owner["started"] == psutil.Process().create_time()
        assert [p.name for p in tier.directory.iterdir()] == [OWNER_FILE]
        DiskTier(tmp_path).close()  # a second start leaves the live folder alone
        assert tier.directory.is_dir()
    finally:
        tier.close()
