"""``--pipeline-parallel``/``--data-parallel`` without a launcher: start the job's processes on this
host through torch.distributed's own launcher (as ``torchrun --standalone`` would), each running
the same command, and end as the first of them to fail ends."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path

from ..errors import FlexoffError


def needs_launch(args) -> int:
    """The processes a command asks for, where it must start them itself; 0 where it runs here
    (alone, or as one of a launch's processes)."""
    from ..deploy.parallel import Launch

    if not getattr(args, "launches", False):
        return 0
    size = (args.pipeline_parallel or 1) * (args.data_parallel or 1)
    return size if size > 1 and Launch.from_env() is None else 0


def check_before_launch(job, size: int) -> None:
    """What each process would refuse before loading a weight, refused once, here."""
    from ..models import resolve_model_config
    from ..deploy.parallel import Launch, Parallel, checked_device

    launch = Launch(0, size, 0, size)
    parallel = Parallel(job.pipeline_parallel, job.data_parallel).resolved(launch)
    checked_device(parallel, resolve_model_config(job.model), launch, job.device)
    job.stage_gpu_mem(0, parallel.pipeline)  # one --gpu-mem, or one per stage


def launch(argv: list[str], size: int, offload_root: str | None = None) -> int:
    """Run ``flexoff ARGV`` as ``size`` processes of one job on this host; the exit code of the
    first process to fail (each printed its own error line), else 0. The offload folders of
    processes that died without removing theirs are removed from ``offload_root``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The launcher's own log lines (workers started, a worker failed, peers stopped) say again what
    # the line below says; its loggers set their own levels, so each is quieted.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if "OMP_NUM_THREADS" not in os.environ:  # the processes share the host's cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // size))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=size, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn")
    try:
        elastic_launch(config, sys.executable)("-m", "flexoff", *argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        if offload_root:
            from ..runtime.offload_dir import remove_dead_folders

            remove_dead_folders(Path(offload_root))
        if code == 2:  # a user error, which the process said in one line
            return 2
        how = f"was killed by signal {-code}" if code < 0 else f"ended with exit code {code}"
        print(f"flexoff: rank {rank} of {size} {how}; the job stopped on every rank", file=sys.stderr)
        return code if code > 0 else 1
    except Exception as exc:  # the launcher itself could not start the processes
        raise FlexoffError(f"could not start {size} processes: {exc}") from None
    return 0
