"""--parallel-timeout is bounded by what torch.distributed's clocks hold: a larger value is one line
and exit code 2 before any process starts, and the largest accepted one joins a process group."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flexoff.commands.main import main
from flexoff.errors import ConfigError
from flexoff.job import MAX_PARALLEL_TIMEOUT_S, Job

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", ["1e300", str(MAX_PARALLEL_TIMEOUT_S * 2)])
def test_a_timeout_past_the_bound_is_one_line_naming_it(capsys, value):
    assert main(["run", "--quiet", "--pipeline-parallel", "2", "--parallel-timeout", value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"--parallel-timeout: must be a number in (0, {MAX_PARALLEL_TIMEOUT_S}], got {value}" in err


def test_the_job_refuses_it_too():
    with pytest.raises(ConfigError, match=r"parallel_timeout must be a number in \(0, 1000000000\]"):
        Job(parallel_timeout=1e300)


def test_the_largest_timeout_joins_a_process_group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = ("import os, torch\n"
            "from flexoff.job import MAX_PARALLEL_TIMEOUT_S\n"
            "from flexoff.deploy.parallel import Launch, Parallel, Ranks\n"
            "ranks = Ranks(Parallel(1, 1, float(MAX_PARALLEL_TIMEOUT_S)), Launch.from_env(os.environ), 2,\n"
            "              torch.device('cpu'))\n"
            "ranks.join()\n"
            "print(ranks.gather('joined'))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("a one-process group did not join within 300 s")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['joined']"
