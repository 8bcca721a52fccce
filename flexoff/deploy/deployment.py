"""One deployment of a model, resolved once: the model's config, the device and dtype, this
process's place in a parallel job (its process group joined, once, with the job's timeout), and,
once planned for a workload, the policy, the stage split and the memory it runs in.

``LLM(...)`` and the commands both describe what they want as a :class:`Request` (its arguments
already checked), resolve it with :func:`resolve_deployment` and plan it for a workload with
:func:`flexoff.deploy.planning.plan_deployment`; the engine is built from the result. Nothing here prints: what
planning does is told to the request's ``log`` (by default Python's ``logging``, logger
``flexoff``), and a measured profile's steps to its ``progress``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import FlexoffError
from ..fileio import offload_root
from ..layout import Capacity
from ..models import ModelConfig, resolve_model
from ..policy import Policy
from ..units import parse_size
from .devices import resolve_device, resolve_dtype
from .parallel import Parallel, Ranks, parallel_ranks

if TYPE_CHECKING:
    from ..planner.default import DefaultPlan

# Everything on the compute device, in batches large enough to keep it busy.
DEFAULT_POLICY = Policy(gpu_batch_size=32)

_logger = logging.getLogger("flexoff")


@dataclass(frozen=True)
class Request:
    """A deployment as asked for, each argument already checked by type and range (by the API's
    ``check_llm_args`` or a ``Job``).

    ``policy``: a Policy, a policy file, "auto" (planned for the workload) or None (the default,
    planned where the job does not fit it); ``overrides``: Policy fields set on top of it (the
    commands' policy flags). ``gpu_mem``: one cap, or as a command gives it, one per pipeline
    stage ("16GiB,24GiB"). ``hardware``: the profile planning uses (a HardwareProfile, a packaged
    profile's name or a profile file, or a callable giving one); None: this machine's saved one,
    measured quickly (and saved) the first time, told to ``profile_log`` and ``progress``.
    ``search_stages``: "auto" plans each pipeline stage for its own layers and GPU cap on
    ``hardware`` as given (the commands' ``--policy auto``); otherwise it plans on this machine's
    capacity, the largest stage for all."""

    model: str
    dummy: bool = False
    policy: Policy | str | os.PathLike | None = None
    overrides: tuple[tuple[str, object], ...] = ()
    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "auto"
    seed: int = 0
    tokenizer: str | None = None
    offload_dir: str | None = None
    gpu_mem: str | int | None = None
    cpu_mem: str | int | None = None
    compress: str = "off"
    hardware: object = None
    parallel: Parallel = field(default_factory=Parallel)
    search_stages: bool = False
    # The caller's own refusals of the resolved deployment and its given policy, run once (by
    # rank 0) before anything is planned.
    check: Callable[["Deployment", Policy | None], None] | None = None
    log: Callable[[str], None] | None = None  # what planning did, a line each
    profile_log: Callable[[str], None] | None = None  # a measured profile's messages
    progress: Callable[[float, str | None], None] | None = None  # and its steps

    @property
    def searched(self) -> bool:
        return isinstance(self.policy, str) and self.policy == "auto"

    def tell(self, message: str) -> None:
        (self.log or _logger.info)(message)

    def tell_profile(self, message: str) -> None:
        (self.profile_log or _logger.info)(message)


@dataclass(frozen=True)
class Deployment:
    """A resolved :class:`Request`. ``deploy.planning.plan_deployment`` fills ``policy``, ``plan``,
    ``capacity`` and ``layers`` (each pipeline stage's decoder layers; None: split evenly)."""

    request: Request
    config: ModelConfig
    checkpoint: Path | None
    device: torch.device
    dtype: torch.dtype
    ranks: Ranks | None
    offload_dir: str  # where the disk tier goes, used only where a policy puts data there
    hardware: Callable  # the planning profile, resolved (or measured) on the first call only
    policy: Policy | None = None
    plan: DefaultPlan | None = None  # where a workload was planned or checked
    capacity: Capacity | None = None
    layers: tuple[int, ...] | None = None

    @property
    def stage(self) -> int:
        return 0 if self.ranks is None else self.ranks.stage

    @property
    def stages(self) -> int:
        return 1 if self.ranks is None else self.ranks.parallel.pipeline

    def on_rank0(self, make):
        """``make()``, run once for the whole job: alone here, in a parallel job on rank 0, its value
        (or its user error) given to every process."""
        return make() if self.ranks is None else self.ranks.on_rank0(make)

    def stage_caps(self) -> tuple[int | None, ...]:
        """Each pipeline stage's GPU cap in bytes (None: the device's); caps given neither once nor
        once per stage are refused."""
        from ..job import stage_sizes

        gpu = self.request.gpu_mem
        sizes = stage_sizes(gpu, self.stages) if isinstance(gpu, str) else [gpu] * self.stages
        return tuple(parse_size(size) if size else None for size in sizes)

    def machine(self, gpu: int | None, uses_disk: bool) -> Capacity:
        """This process's memory: a parallel job's processes on one host share its RAM (the cpu
        cap is the host's); the disk tier's only where the policy puts data there."""
        from ..runtime.memory import machine_capacity

        cpu = parse_size(self.request.cpu_mem) if self.request.cpu_mem else None
        capacity = machine_capacity(self.device, gpu, cpu, self.offload_dir if uses_disk else None)
        if self.ranks is not None and capacity.cpu is not None:
            capacity = replace(capacity, cpu=capacity.cpu // self.ranks.launch.local_world)
        return capacity


def resolve_deployment(request: Request) -> Deployment:
    """The model, device, process ranks (the group joined, with ``request.parallel``'s timeout),
    and dtype of ``request``, each resolved once."""
    # A local directory, a registry name (dummy only) or a Hugging Face Hub id (fetched as needed).
    config, checkpoint = resolve_model(request.model, request.dummy)
    device = resolve_device(request.device)
    ranks = parallel_ranks(request.parallel, config, request.device)
    if ranks is not None:
        device = ranks.device
    dtype = resolve_dtype(request.dtype, device, config, planned=request.searched)
    where = offload_root(request.offload_dir)
    return Deployment(request, config, checkpoint, device, dtype, ranks, where, _hardware(request, device, where))


def given_policy(request: Request) -> Policy | None:
    """The policy the request names (a file loaded), its overrides on top; None for the default
    or "auto" (the overrides then go on top of what is planned)."""
    policy = request.policy
    if request.searched:
        return None
    given = policy if isinstance(policy, Policy) else Policy.load(policy) if policy else None
    if request.overrides:
        given = replace(given or DEFAULT_POLICY, **dict(request.overrides))
    return given


def _hardware(request: Request, device: torch.device, offload_dir: str) -> Callable:
    """The planning profile, as a call made at most once: measuring one takes a while, and only
    planning needs it."""
    hardware = request.hardware

    @cache
    def profile():
        if callable(hardware):
            return hardware()
        if isinstance(hardware, (str, os.PathLike)):
            from ..planner.hardware import resolve_hardware

            return resolve_hardware(str(hardware))
        if hardware is not None:
            return hardware
        from ..profiler.machine import saved_or_measured_profile

        return saved_or_measured_profile(device, offload_dir, request.tell_profile, request.progress)

    return profile


def no_workload_error() -> FlexoffError:
    return FlexoffError("policy 'auto' plans for a job: pass workload=Workload(prompt_len, gen_len, "
                        "num_prompts) too, or pass the policy flexoff.planner.search_policy(config, "
                        "Workload(...), hardware).policy")
