"""The LLM a job describes, made through the API; what planning does on the way is printed on stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from typing import TYPE_CHECKING

from ..errors import FlexoffError, PolicyError, TokenizerError
from ..job import Job
from .args import unused_flags
from .report import warning_line

if TYPE_CHECKING:
    from ..planner.cost_model import Workload


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def policy_of(job: Job, workload: Callable[[], Workload] | None, ranks=None) -> tuple[list, list[int] | None]:
    """The job's policy: its file (or a search, for auto), then its overrides on top; None for the
    default. A list of one, or in a parallel job (``ranks``) searched for, one per pipeline stage,
    with each stage's decoder layers (None: split evenly)."""
    from ..api import DEFAULT_POLICY
    from ..policy import Policy

    source = job.policy
    counts = None
    if source.searched:
        policies, counts = searched_policies(job, workload, ranks)
    else:
        policies = [Policy.load(source.file) if source.file else None]
        lossy = _compressed_parts(job, policies[0]) if policies[0] is not None and source.compress == "off" else ""
        if lossy:
            raise PolicyError(f"{source.file} compresses the {lossy}, which contradicts "
                              "--compress off; drop --compress off or use a lossless policy")
    if source.overrides:
        policies = [replace(policy or DEFAULT_POLICY, **dict(source.overrides)) for policy in policies]
    return policies, counts


def _compressed_parts(job: Job, policy) -> str:
    """'weights and cache': the parts ``policy`` compresses, but weights it reads as the checkpoint
    stores them, which it does not compress."""
    weight = policy.compress_weight
    if weight is not None:
        from ..models import resolve_model_config

        if resolve_model_config(job.model).stored_compression == weight:
            weight = None
    return " and ".join(part for part, config in (("weights", weight), ("cache", policy.compress_cache))
                        if config is not None)


def searched_policies(job: Job, workload: Callable[[], Workload] | None, ranks=None) -> tuple[list, list[int] | None]:
    """The planner's best policy for this job on its hardware profile, within its memory caps. In a
    parallel job (``ranks``), one per pipeline stage, each for its layers and its GPU's cap, with
    the host's memory shared by the processes on it, all of one batch shape."""
    from ..llm_args import resolve_device, resolve_dtype
    from ..models import resolve_model_config
    from ..planner.pipeline import plan_pipeline, stage_hardware
    from ..planner.report import policy_summary
    from ..units import parse_size

    if workload is None:
        raise FlexoffError("--policy auto works with `flexoff run` and `flexoff batch`, not `flexoff bench`: "
                           "save a policy with `flexoff search --output FILE` and pass --policy FILE")
    device = resolve_device(job.device)
    if resolve_dtype(job.dtype, device, planned=True).itemsize != 2:
        raise FlexoffError("--policy auto plans 16-bit weights and cache; pass --dtype float16 or bfloat16 "
                           "(or auto, the model's own 16-bit format)")
    config = resolve_model_config(job.model)
    stages, replicas = (1, 1) if ranks is None else (ranks.parallel.pipeline, ranks.parallel.data)
    gpu_caps = [parse_size(gpu) if (gpu := job.stage_gpu_mem(stage, stages)) else None for stage in range(stages)]
    hardware = stage_hardware(hardware_profile(job, device), gpu_caps, 1 if ranks is None else ranks.launch.local_world,
                              parse_size(job.cpu_mem) if job.cpu_mem else None)
    wanted = workload()
    plan = plan_pipeline(config, wanted, hardware, replicas, compress=job.policy.planning_compress)
    for stage in plan.stages:
        where = "" if stages == 1 else f"stage {stage.index} (layers {stage.layers.start}-{stage.layers.stop - 1}): "
        _log(f"searched   {where}{policy_summary(stage.policy)} for prompt {wanted.prompt_len}, generate "
             f"{wanted.gen_len} on {stage.hardware.name}: {stage.prediction.total_throughput:.4g} token/s predicted")
    return plan.policies, (plan.layer_counts if stages > 1 else None)


def job_dtype(job: Job):
    """The dtype the job runs in: its own; "auto" with --policy auto is the model's 16-bit format
    on every device, the CPU included, since that is what the planner plans for."""
    if not (job.policy.searched and job.dtype == "auto"):
        return job.dtype
    import torch

    from ..llm_args import resolve_dtype
    from ..models import resolve_model_config

    return resolve_dtype(job.dtype, torch.device("cpu"), resolve_model_config(job.model), planned=True)


def hardware_profile(job: Job, device):
    """The profile planning uses: the job's, else this machine's saved one, measured quickly (and
    saved) the first time."""
    from ..profiler.machine import saved_or_measured_profile
    from ..planner.hardware import resolve_hardware
    from .report import ProgressLine

    if job.policy.hardware:
        return resolve_hardware(job.policy.hardware)
    return saved_or_measured_profile(device, job.offload_root, lambda message: _log(f"profile    {message}"),
                                     ProgressLine("profile    measuring"))


def job_ranks(job: Job):
    """This process's place in the job's parallel launch, joined; None when it runs alone."""
    from ..models import resolve_model_config
    from ..parallel import DEFAULT_TIMEOUT_S, Launch, Parallel, parallel_ranks

    timeout = DEFAULT_TIMEOUT_S if job.parallel_timeout is None else job.parallel_timeout
    parallel = Parallel(job.pipeline_parallel, job.data_parallel, timeout)
    if parallel.asked == 1 and Launch.from_env() is None:
        return None
    return parallel_ranks(parallel, resolve_model_config(job.model), job.device)


def make_llm(job: Job, workload: Callable[[], Workload] | None = None, args=None):
    """The LLM the job describes. ``workload`` (a callable giving the planner's Workload) serves
    --policy auto, lets a job that cannot fit be refused before anything is allocated, and, with no
    policy given, plans a policy when the job does not fit the device (the plan is printed).
    ``args``: the command's flags, each one that has no effect on the job named in a warning."""
    from ..api import LLM
    from ..llm_args import resolve_device

    workload = cache(workload) if workload is not None else None  # text prompts are tokenized once
    ranks = job_ranks(job)
    stage, stages = (0, 1) if ranks is None else (ranks.stage, ranks.parallel.pipeline)

    def plan():
        job.stage_gpu_mem(0, stages)  # caps that do not fit the stages are refused first (once, by rank 0)
        return policy_of(job, workload, ranks)

    # A parallel job's processes must agree on the batch shape: rank 0 plans (and alone reports it).
    policies, layers = plan() if ranks is None else ranks.on_rank0(plan)
    gpu_mem = job.stage_gpu_mem(stage, stages)
    policy = policies[stage] if len(policies) > 1 else policies[0]

    def measured_workload():
        try:
            return workload()
        except TokenizerError:  # text without a tokenizer: the prompts' own check names the line at fault
            return None

    llm = LLM(job.model, dummy=job.dummy, policy=policy, dtype=job_dtype(job), device=job.device,
              seed=job.seed, tokenizer=job.tokenizer, offload_dir=job.offload_root,
              gpu_mem=gpu_mem, cpu_mem=job.cpu_mem, compress=job.policy.planning_compress,
              workload=measured_workload if workload is not None else None,
              hardware=lambda: hardware_profile(job, resolve_device(job.device)),
              pipeline_parallel_size=job.pipeline_parallel, data_parallel_size=job.data_parallel,
              pipeline_layers=layers)
    if ranks is None or ranks.rank == 0:
        if llm.plan is not None and llm.plan.message:
            _log(llm.plan.message)
        for line in unused_flags(args, llm) if args is not None else ():
            _log(warning_line(line))
    return llm
