"""Planning a pipeline: the model's layers split between S devices (``layout.stage_split``), each
device's placement planned for its own layers and its own GPU memory, and one batch shape for all
of them, since a GPU batch flows through every stage.

Each device runs its layers for every token of every block, so the pipeline generates at the pace
of its slowest device: the job's throughput is that device's predicted throughput for its layers,
times the replicas. With S blocks in rotation every device has a block to work on once the
pipeline fills (one block's token on each), so the planner gives each replica's blocks a share of
the prompts small enough for S of them. The processes of a host share its RAM, so each device's
host memory is its share. The hidden states between devices (a GPU batch's rows × hidden size per
token) are not priced: they are thousands of times smaller than a stage's weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..errors import PolicyError
from ..layout import job_bytes, pins_host_memory
from ..layout.stage_split import range_layers, stage_ranges, stage_view
from ..models import ModelConfig
from ..policy import TIERS, Policy
from .cost_model import Prediction, Workload
from .hardware import HardwareProfile
from .search import GPU_BATCH_SIZES, NUM_GPU_BATCHES, search_policy


@dataclass(frozen=True)
class StagePlan:
    index: int
    layers: range  # its decoder layers
    hardware: HardwareProfile  # with this device's memory
    prediction: Prediction

    @property
    def policy(self) -> Policy:
        return self.prediction.policy


@dataclass(frozen=True)
class PipelinePlan:
    stages: tuple[StagePlan, ...]
    replicas: int = 1

    @property
    def policies(self) -> list[Policy]:
        return [stage.policy for stage in self.stages]

    @property
    def layer_counts(self) -> list[int]:
        return [len(stage.layers) for stage in self.stages]

    @property
    def slowest(self) -> StagePlan:
        return min(self.stages, key=lambda stage: stage.prediction.total_throughput)

    @property
    def throughput(self) -> float:
        """The job's predicted tokens per second: the slowest device's, on every replica."""
        return self.slowest.prediction.total_throughput * self.replicas


def stage_hardware(profile: HardwareProfile, gpu_caps: list[int | None], processes: int, cpu: int | None = None,
                   disk: int | None = None) -> list[HardwareProfile]:
    """Each stage's machine, one GPU cap a stage (None: the profile's), where ``processes`` share
    the host: its memory (``cpu`` and ``disk``: the host's caps, else the profile's) and perhaps the
    way from it to their GPUs (``HardwareProfile.sharing_links``)."""
    shared = profile.sharing_links(processes)
    cpu = profile.cpu_memory if cpu is None else cpu
    return [shared.with_memory(gpu, cpu // processes, None if disk is None else disk // processes)
            for gpu in gpu_caps]


def stage_workload(workload: Workload, pipeline: int, replicas: int = 1) -> Workload:
    """What each replica's blocks are planned for: a share of the prompts that makes at least
    ``pipeline`` blocks a replica, so that every device of its pipeline has one."""
    if workload.num_prompts is None:
        return workload
    return workload.with_prompts(max(1, math.ceil(workload.num_prompts / (pipeline * replicas))))


def plan_pipeline(config: ModelConfig, workload: Workload, hardware: list[HardwareProfile], replicas: int = 1,
                  **options) -> PipelinePlan:
    """The best plan over ``len(hardware)`` devices (each profile with its device's GPU memory and
    host-memory share). Every device holds as many blocks as the pipeline has devices (they rotate
    through it), so the candidate batch shapes are each device's own shape alone and smaller ones,
    each planned with room for all its blocks; the plan whose slowest device is fastest wins.
    The layers are split evenly, then, where the devices differ, in proportion to each one's speed
    in that plan (and halfway there), and the best split is kept. ``options`` go to ``search_policy`` (compress,
    cpu_attention). Raises PolicyError where some device fits no policy."""
    count = len(hardware)
    if count > config.num_layers:
        raise PolicyError(f"{count} pipeline stages are more than the {config.num_layers} layers of {config.name}")
    share = stage_workload(workload, count, replicas)
    even = [len(range_layers(r, config.num_layers)) for r in stage_ranges(config.num_layers, count)]
    plan = _plan_split(config, share, hardware, replicas, even, options)
    if len(set(hardware)) > 1:
        # A device's time a token is its layers over its throughput: give each layers in proportion
        # to its speed, or halfway there (a device's plan changes with its layers, so the
        # proportion is only a guide).
        speed = [len(stage.layers) * stage.prediction.total_throughput for stage in plan.stages]
        balanced = _apportion(config.num_layers, speed)
        halfway = _apportion(config.num_layers, [e + b for e, b in zip(even, balanced)])
        for counts in dict.fromkeys(tuple(c) for c in (balanced, halfway) if c != even):
            try:
                other = _plan_split(config, share, hardware, replicas, list(counts), options)
            except PolicyError:
                continue
            if other.throughput > plan.throughput:
                plan = other
    return plan


def _apportion(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights``, each part at least 1 (largest remainders)."""
    scaled = [max(w, 1e-12) * (total - len(weights)) / sum(max(w, 1e-12) for w in weights) for w in weights]
    parts = [1 + int(x) for x in scaled]
    for i in sorted(range(len(weights)), key=lambda i: int(scaled[i]) - scaled[i])[:total - sum(parts)]:
        parts[i] += 1
    return parts


def _plan_split(config: ModelConfig, share: Workload, hardware: list[HardwareProfile], replicas: int,
                counts: list[int], options: dict) -> PipelinePlan:
    """The best plan with ``counts`` decoder layers on each device."""
    count = len(hardware)
    layers = [range_layers(owned, config.num_layers) for owned in stage_ranges(config.num_layers, count, counts)]
    views = {len(r): stage_view(config, len(r)) for r in layers}
    searched: dict[tuple, Prediction | None] = {}

    def at(stage: int, shape: tuple[int, int]) -> Prediction | None:
        """The device's best prediction at a batch shape, with ``count`` blocks held; None where none fits."""
        key = (len(layers[stage]), hardware[stage], shape)
        if key not in searched:
            try:
                searched[key] = _rotating(views[len(layers[stage])], share, hardware[stage], count,
                                          {**options, "gpu_batch_sizes": [shape[0]], "num_gpu_batches": [shape[1]]})
            except PolicyError:
                searched[key] = None
        return searched[key]

    try:
        alone = {(n, hw): search_policy(views[n], share, hw, **options).policy
                 for n, hw in dict.fromkeys((len(r), hw) for r, hw in zip(layers, hardware))}
    except PolicyError as exc:
        raise PolicyError(f"a pipeline stage of {config.name} fits no policy: {exc}") from None
    shapes = dict.fromkeys(shape for policy in alone.values() for shape in _smaller_shapes(policy, count))
    plans = []
    for shape in shapes:
        predictions = [at(stage, shape) for stage in range(count)]
        if all(p is not None for p in predictions):
            plans.append(PipelinePlan(tuple(StagePlan(i, layers[i], hardware[i], p)
                                            for i, p in enumerate(predictions)), replicas))
    if not plans:
        raise PolicyError(f"no batch shape the planner tried lets every stage of {config.name} hold its {count} "
                          f"blocks in rotation: give the GPUs more memory (--gpu-mem), or use fewer stages")
    return max(plans, key=lambda plan: plan.throughput)


def _rotating(view: ModelConfig, workload: Workload, hardware: HardwareProfile, blocks: int, options: dict,
              attempts: int = 4) -> Prediction:
    """The best prediction for a device that holds ``blocks`` blocks at once (in rotation through
    the pipeline): the search plans one, so the others' caches and activations are taken off the
    memory it may plan with, until the plan fits with all of them."""
    limit = hardware
    for attempt in range(attempts):
        prediction = search_policy(view, workload, limit, **options).prediction
        policy = prediction.policy
        pinned = pins_host_memory(policy.pin_cpu_memory)
        extra = {tier: later - first for tier, (first, later) in zip(TIERS, zip(
            *(job_bytes(view, policy, torch.float16, workload.prompt_len, workload.gen_len, pinned, blocks=n,
                        prefix_len=workload.batch_prefix(policy.gpu_batch_size),
                        prefix_rows=workload.prefix_rows(policy.gpu_batch_size)).values()
              for n in (1, blocks))))}
        over = {tier: prediction.peak_memory[tier] + extra[tier] - hardware.capacity(tier) for tier in TIERS}
        if all(value <= 0 for value in over.values()):
            return replace(prediction, peak_memory={tier: prediction.peak_memory[tier] + extra[tier] for tier in TIERS},
                           capacity={tier: hardware.capacity(tier) for tier in TIERS})
        # The search fills what is taken off again, nearly: taking off only the overflow converges
        # too slowly, so each attempt takes off twice what the last one would have.
        limit = limit.with_memory(*(getattr(limit, f"{tier}_memory") - max(0, over[tier]) * 2 ** attempt
                                    for tier in TIERS))
    raise PolicyError(f"no policy holds {blocks} blocks in rotation within the memory of {hardware.name}")


def _smaller_shapes(policy: Policy, blocks: int) -> list[tuple[int, int]]:
    """Batch shapes to try where ``blocks`` blocks are held at once: the shape a device would run
    alone, and those down to 1/(2 * blocks) of its rows (a held block's memory is taken from them)."""
    size, batches = policy.gpu_batch_size, policy.num_gpu_batches
    if blocks == 1:
        return [(size, batches)]
    least = size * batches / (2 * blocks)
    return [(s, n) for s in GPU_BATCH_SIZES if s <= size for n in NUM_GPU_BATCHES if n <= batches and s * n >= least]
