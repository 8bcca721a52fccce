"""The policy a run takes when none is given: everything on the compute device when the job fits
there, otherwise a lossless policy the planner searches for this job on a machine's profile.

Whether a job fits is the layout's figure (:func:`flexoff.layout.job_bytes`), the one the engine
checks each block against, so the default is kept exactly when the engine would accept it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..errors import PolicyError
from ..fileio import usable_offload_dir
from ..layout import Capacity, check_fits, job_bytes, overflow, pins_host_memory, tier_limits, tier_name
from ..models.config import ModelConfig
from ..policy import CompressionConfig, Policy
from ..units import format_size
from .cost_model import Workload
from .coverage import extrapolation_note
from .frame import Prediction
from .hardware import HardwareProfile
from .report import policy_summary
from .search import SearchResult, search_policy


def job_what(config: ModelConfig, policy: Policy, workload: Workload) -> str:
    """The job as error messages name it."""
    return (f"{config.name} with a block of {policy.block_size} sequences of up to "
            f"{workload.prompt_len}+{workload.gen_len} tokens")


def job_needs(config: ModelConfig, policy: Policy, dtype: torch.dtype, workload: Workload) -> dict[str, int]:
    """Bytes per tier the job takes under ``policy`` (weights and one full block, each GPU batch's
    shared prefix once)."""
    return job_bytes(config, policy, dtype, workload.prompt_len, workload.gen_len,
                     pins_host_memory(policy.pin_cpu_memory),
                     prefix_len=workload.batch_prefix(policy.gpu_batch_size),
                     prefix_rows=workload.prefix_rows(policy.gpu_batch_size))


def check_job(config: ModelConfig, policy: Policy, dtype: torch.dtype, workload: Workload,
              capacity: Capacity) -> None:
    """Refuse, before anything is allocated, a job that cannot fit the machine under ``policy``."""
    check_fits(job_needs(config, policy, dtype, workload), capacity, job_what(config, policy, workload))


def _groups(compression: CompressionConfig) -> str:
    return f"{compression.bits}-bit groups of {compression.group_size}"


def weights_as_stored(policy: Policy, config: ModelConfig) -> Policy:
    """``policy`` for ``config``'s model, whose checkpoint may store its matrices compressed
    (``config.stored_compression``): read as stored, they are never dequantized and quantized again.
    A policy without weight compression takes the stored format (weights are never inflated unasked),
    one with that format is kept, and another is refused."""
    stored, asked = config.stored_compression, policy.compress_weight
    if stored is None or asked == stored:
        return policy
    if asked is None:
        return replace(policy, compress_weight=stored)
    raise PolicyError(f"{config.name} stores its matrices as {_groups(stored)}; a policy cannot recompress them as "
                      f"{_groups(asked)}: give compress_weight {{bits: {stored.bits}, group_size: {stored.group_size}}} "
                      f"(--compress-weight --weight-bits {stored.bits} --weight-group {stored.group_size}) or none")


@dataclass(frozen=True)
class DefaultPlan:
    policy: Policy
    search: SearchResult | None  # None: the default fits as it is
    message: str | None  # what was planned and why, for the user; None when nothing was
    offload_dir: str | None = None  # where a planned policy's disk data goes
    # The searched policy's prediction: the search's, or a one-stage deployment's searched stage.
    prediction: Prediction | None = None


def fit_job(config: ModelConfig, workload: Workload, policy: Policy | None, dtype: torch.dtype,
            capacity: Capacity, hardware: HardwareProfile | Callable[[], HardwareProfile], default: Policy,
            offload_dir: str | None, compress: str = "off", search: bool = False) -> DefaultPlan:
    """The policy a job runs: ``policy`` if given, checked against ``capacity``; else
    :func:`plan_default`'s, with the disk tier in ``offload_dir`` (the temp directory if None),
    ``hardware`` (a profile, or a callable giving one, called only when needed) and ``compress``
    (what planning may do with lossy compression). ``search``: plan even where the default fits.
    Both policies read a model stored compressed as stored (:func:`weights_as_stored`)."""
    # A job past the model's positions is refused later, naming its prompt; sized as it asks, it
    # could overflow the sizing first.
    prompt_len = min(workload.prompt_len, config.max_positions - 1)
    workload = workload.with_generation(prompt_len, max(1, config.max_positions - prompt_len))
    if policy is not None:
        policy = weights_as_stored(policy, config)
        check_job(config, policy, dtype, workload, capacity)
        return DefaultPlan(policy, None, None)
    return plan_default(config, workload, capacity, dtype, hardware, default, offload_dir or tempfile.gettempdir(),
                        compress, search)


def plan_default(config: ModelConfig, workload: Workload, capacity: Capacity, dtype: torch.dtype,
                 hardware: HardwareProfile | Callable[[], HardwareProfile], default: Policy,
                 offload_dir: str | None = None, compress: str = "off", search: bool = False) -> DefaultPlan:
    """``default`` when the job fits the machine under it; otherwise the best policy for the job on
    ``hardware`` (a profile, or a callable giving one, called only when needed) within ``capacity``
    and the free space of ``offload_dir`` (None: no disk), lossless unless ``compress`` ("auto",
    "on") lets it compress; with ``search``, the searched policy even where ``default`` fits. Raises
    PolicyError when planning cannot help (the device is the CPU, whose RAM the cpu tier shares, and
    no --gpu-mem sets it apart) or no policy fits."""
    default = weights_as_stored(default, config)
    needed = job_needs(config, default, dtype, workload)
    tier = overflow(needed, capacity)
    if tier is None and not search:
        return DefaultPlan(default, None, None)
    if tier is None:
        short = f"policy auto for prompt {workload.prompt_len}, generate {workload.gen_len}"
    else:
        if capacity.shared and capacity.gpu is None:
            check_fits(needed, capacity, job_what(config, default, workload))  # raises: only disk could help
        limit = tier_limits(needed, capacity)[tier]
        short = (f"{config.name} needs {format_size(needed[tier])} on the {tier_name(tier, capacity.device)} tier "
                 f"with everything there ({format_size(limit)} available)")
    if dtype.itemsize != 2:
        raise PolicyError(f"{short}; the planner plans 16-bit weights and cache: pass --dtype float16 or bfloat16 "
                          "to plan a policy, or place the data yourself (--percent, --policy FILE)")
    if offload_dir is not None:
        capacity = replace(capacity, disk=shutil.disk_usage(usable_offload_dir(offload_dir)).free)
    profile = hardware() if callable(hardware) else hardware
    profile = profile.with_memory(*planning_memory(capacity))
    try:
        result = search_policy(config, workload, profile, compress=compress)
    except PolicyError as exc:
        if compress != "off":
            raise PolicyError(f"{short}, and no policy fits either: {exc}") from None
        if config.stored_compression is not None:  # its weights are compressed already
            raise PolicyError(f"{short}, and no policy with a lossless cache fits either: {exc}; let planning "
                              "compress the cache (--compress auto)") from None
        raise PolicyError(f"{short}, and no lossless policy fits either: {exc}; store the weights "
                          "4-bit (--compress-weight), or let planning compress (--compress auto)") from None
    check_job(config, result.policy, dtype, workload, capacity)
    message = (f"planned    {policy_summary(result.policy)} on {profile.name}, "
               f"{result.throughput:.4g} token/s predicted ({short})")
    note = extrapolation_note(profile, workload)
    if note:
        message += f"\n           {note}"
    return DefaultPlan(result.policy, result, message, offload_dir, result.prediction)


def planning_memory(capacity: Capacity) -> tuple[int | None, int | None, int]:
    """(gpu, cpu, disk) bytes the planner may plan with: where the device is the CPU, the cpu tier
    is the RAM the device's cap leaves; without an offload directory there is no disk."""
    cpu = capacity.cpu
    if capacity.shared and cpu is not None and capacity.gpu is not None:
        cpu = max(0, cpu - capacity.gpu)
    return capacity.gpu, cpu, capacity.disk or 0

