"""The LLM a job describes: the job's deployment resolved once (:mod:`flexoff.deploy`), then made
through the API; what planning does on the way is printed on stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING

from ..errors import FlexoffError, PolicyError, TokenizerError
from ..job import Job
from .args import unused_flags
from .report import warning_line

if TYPE_CHECKING:
    from ..deploy.deployment import Deployment
    from ..planner.cost_model import Workload


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def job_deployment(job: Job) -> Deployment:
    """The job's deployment: its model, device and dtype, and in a parallel job this process's
    place, the process group joined (once, waiting --parallel-timeout for its peers). What it
    plans is printed here, and so is a hardware profile's measuring."""
    from ..deploy.deployment import Request, resolve_deployment
    from ..deploy.parallel import DEFAULT_TIMEOUT_S, Parallel
    from .report import ProgressLine

    source = job.policy
    timeout = DEFAULT_TIMEOUT_S if job.parallel_timeout is None else job.parallel_timeout
    named = source.hardware
    # --hardware is read only where something is planned.
    hardware = (lambda: _named_profile(named)) if named else None
    request = Request(job.model, job.dummy, source.file, source.overrides, dtype=job.dtype, device=job.device,
                      seed=job.seed, tokenizer=job.tokenizer, offload_dir=job.offload_root, gpu_mem=job.gpu_mem,
                      cpu_mem=job.cpu_mem, compress=source.planning_compress, hardware=hardware,
                      parallel=Parallel(job.pipeline_parallel, job.data_parallel, timeout), search_stages=True,
                      check=_refusals(job), log=_log, profile_log=lambda message: _log(f"profile    {message}"),
                      progress=ProgressLine("profile    measuring"))
    return resolve_deployment(request)


def _named_profile(name: str):
    from ..planner.hardware import resolve_hardware

    return resolve_hardware(name)


def _refusals(job: Job):
    """What the commands refuse of a job's policy before planning: --policy auto where the job has no
    workload to plan for or computes in 32 bits, and a policy file that compresses under --compress off."""
    def check(deployment: Deployment, given) -> None:
        if job.policy.searched:
            if deployment.dtype.itemsize != 2:
                raise FlexoffError("--policy auto plans 16-bit weights and cache; pass --dtype float16 or bfloat16 "
                                   "(or auto, the model's own 16-bit format)")
            return
        lossy = _compressed_parts(deployment, given) if job.policy.file and job.policy.compress == "off" else ""
        if lossy:
            raise PolicyError(f"{job.policy.file} compresses the {lossy}, which contradicts "
                              "--compress off; drop --compress off or use a lossless policy")

    return check


def _compressed_parts(deployment: Deployment, policy) -> str:
    """'weights and cache': the parts ``policy`` compresses, but weights it reads as the checkpoint
    stores them, which it does not compress."""
    weight = policy.compress_weight
    if weight is not None and deployment.config.stored_compression == weight:
        weight = None
    return " and ".join(part for part, config in (("weights", weight), ("cache", policy.compress_cache))
                        if config is not None)


def make_llm(deployment: Deployment, job: Job, workload: Callable[[], Workload] | None = None, args=None):
    """The LLM of the job's deployment. ``workload`` (a callable giving the planner's Workload)
    serves --policy auto, lets a job that cannot fit be refused before anything is allocated, and,
    with no policy given, plans a policy when the job does not fit the device (the plan is printed).
    ``args``: the command's flags, each one that has no effect on the job named in a warning."""
    from ..api import LLM

    if job.policy.searched and workload is None:  # a command's bug, never the user's
        raise ValueError("--policy auto needs the job's workload to plan for")
    workload = cache(workload) if workload is not None else None  # text prompts are tokenized once

    def measured_workload():
        try:
            return workload()
        except TokenizerError:  # text without a tokenizer: the prompts' own check names the line at fault
            return None

    planned = workload if job.policy.searched else measured_workload if workload is not None else None
    llm = LLM.from_deployment(deployment, planned, prefix_sharing=job.prefix_sharing,
                              cuda_graphs=job.cuda_graphs)
    if llm.ranks is None or llm.ranks.rank == 0:
        if llm.plan is not None and llm.plan.message:
            _log(llm.plan.message)
        for line in unused_flags(args, llm) if args is not None else ():
            _log(warning_line(line))
    return llm
