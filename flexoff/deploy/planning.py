"""A deployment's policy for its workload: the one place that calls the planner. A given policy is
checked against the machine; the default is kept where the job fits it, else planned; "auto" is
planned, for this machine's capacity (``planner.default.fit_job``) or, as the commands plan it,
each pipeline stage for its own layers and GPU cap (``planner.pipeline.plan_pipeline``).

In a parallel job rank 0 plans for every process, which must agree on batch sizes, and each
process then runs its own stage's policy.
"""

from __future__ import annotations

import os
from dataclasses import replace

from ..policy import Policy
from ..units import parse_size
from .deployment import DEFAULT_POLICY, Deployment, given_policy, no_workload_error


def _as_stored(policy: Policy | None, config) -> Policy | None:
    """``policy`` reading the checkpoint's matrices as it stores them (``weights_as_stored``); the
    planner (and its solver) loads only for a model stored compressed."""
    if policy is None or config.stored_compression is None:
        return policy
    from ..planner.default import weights_as_stored

    return weights_as_stored(policy, config)


def plan_deployment(deployment: Deployment, workload) -> Deployment:
    """``deployment`` with its policy, stage split and capacity for ``workload`` (a planner
    Workload, a callable giving one or None, or None): with one, a job that cannot fit is refused
    and the policy planned where asked or needed (rank 0 plans for the whole job)."""
    request, config = deployment.request, deployment.config

    def first():
        caps, given = deployment.stage_caps(), given_policy(request)
        if request.check is not None:
            request.check(deployment, given)
        return caps, given

    # What the whole job would refuse is refused once, by rank 0.
    caps, given = deployment.on_rank0(first)
    if request.searched and workload is None:
        raise no_workload_error()
    gpu = caps[deployment.stage]
    # Read as the checkpoint stores them, refused where a policy would recompress them.
    given, default = _as_stored(given, config), _as_stored(DEFAULT_POLICY, config)
    policy = given or default
    capacity = deployment.machine(gpu, policy.uses_disk)
    job = workload() if callable(workload) else workload
    if job is None:
        return replace(deployment, policy=policy, capacity=capacity, layers=request.parallel.layers)
    if isinstance(request.hardware, (str, os.PathLike)):
        deployment.hardware()  # a profile named is read now: a wrong name is refused even where the job fits

    def plan():
        return _plan(deployment, job, given, default, capacity, caps)

    plan, policies, layers = deployment.on_rank0(plan)
    policy = plan.policy if policies is None else _as_stored(policies[deployment.stage], config)
    if policy.uses_disk and capacity.disk is None:  # a plan put data on disk
        capacity = deployment.machine(gpu, True)
    return replace(deployment, ranks=_staged(deployment, layers), policy=policy, plan=plan, capacity=capacity,
                   layers=layers)


def _staged(deployment: Deployment, layers):
    """The process's ranks with the stages' layers as planned."""
    ranks = deployment.ranks
    if ranks is None or layers is None or layers == ranks.parallel.layers:
        return ranks
    return ranks.with_layers(layers)


def _plan(deployment: Deployment, job, given, default, capacity, caps):
    """(plan, each stage's policy or None where all run the plan's, the stages' layers): the plan
    checks the job's policy, or plans one, on this process's capacity."""
    from ..planner.default import fit_job

    request = deployment.request
    layers, policies, prediction = request.parallel.layers, None, None
    if request.searched and request.search_stages:
        policies, layers, prediction = _search_stages(deployment, job, caps)
        given = policies[0]  # rank 0 runs the first stage
        if given.uses_disk and capacity.disk is None:
            capacity = deployment.machine(caps[0], True)
    ranks = _staged(deployment, layers)
    # A pipeline's stages must agree on batch sizes: planned for the largest, every stage runs it.
    config = deployment.config if ranks is None else ranks.largest_stage(deployment.config)
    plan = fit_job(config, job, given, deployment.dtype, capacity, deployment.hardware, default,
                   deployment.offload_dir, request.compress, search=request.searched and policies is None)
    if prediction is not None:
        plan = replace(plan, prediction=prediction)
    return plan, policies, layers


def _search_stages(deployment: Deployment, job, caps):
    """The planner's best policy for each pipeline stage on the request's hardware profile, each
    for its layers and its GPU's cap, with the host's memory shared by the processes on it, all of
    one batch shape; the request's overrides on top. The stages' layers, where there are several;
    the prediction of the one stage's policy where there is one and nothing overrides it."""
    from ..planner.coverage import extrapolation_note
    from ..planner.pipeline import plan_pipeline, stage_hardware
    from ..planner.report import policy_summary

    request, ranks = deployment.request, deployment.ranks
    replicas, processes = (1, 1) if ranks is None else (ranks.parallel.data, ranks.launch.local_world)
    cpu = parse_size(request.cpu_mem) if request.cpu_mem else None
    hardware = stage_hardware(deployment.hardware(), list(caps), processes, cpu)
    plan = plan_pipeline(deployment.config, job, hardware, replicas, compress=request.compress)
    several = deployment.stages > 1
    for stage in plan.stages:
        where = f"stage {stage.index} (layers {stage.layers.start}-{stage.layers.stop - 1}): " if several else ""
        request.tell(f"searched   {where}{policy_summary(stage.policy)} for prompt {job.prompt_len}, generate "
                     f"{job.gen_len} on {stage.hardware.name}: {stage.prediction.total_throughput:.4g} token/s "
                     "predicted")
    note = extrapolation_note(hardware[0], job)
    if note:
        request.tell(f"           {note}")
    policies = plan.policies
    if request.overrides:
        policies = [replace(policy, **dict(request.overrides)) for policy in policies]
    prediction = plan.stages[0].prediction if not several and not request.overrides else None
    return policies, (tuple(plan.layer_counts) if several else None), prediction
