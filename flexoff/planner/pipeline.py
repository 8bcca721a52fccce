"""Planning a pipeline: the model's layers split between S devices (``layout.pipeline``), each
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

from ..errors import PolicyError
from ..layout.pipeline import range_layers, stage_ranges, stage_view
from ..models import ModelConfig
from ..policy import Policy
from .cost_model import Prediction, Workload
from .hardware import HardwareProfile
from .search import search_policy


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
    def slowest(self) -> StagePlan:
        return min(self.stages, key=lambda stage: stage.prediction.total_throughput)

    @property
    def throughput(self) -> float:
        """The job's predicted tokens per second: the slowest device's, on every replica."""
        return self.slowest.prediction.total_throughput * self.replicas


def stage_workload(workload: Workload, pipeline: int, replicas: int = 1) -> Workload:
    """What each replica's blocks are planned for: a share of the prompts that makes at least
    ``pipeline`` blocks a replica, so that every device of its pipeline has one."""
    if workload.num_prompts is None:
        return workload
    return replace(workload, num_prompts=max(1, math.ceil(workload.num_prompts / (pipeline * replicas))))


def plan_pipeline(config: ModelConfig, workload: Workload, hardware: list[HardwareProfile], replicas: int = 1,
                  **options) -> PipelinePlan:
    """The best plan over ``len(hardware)`` devices (each profile with its device's GPU memory and
    host-memory share). Each device's own best batch shape is a candidate for all of them; the
    plan whose slowest device is fastest wins. ``options`` go to ``search_policy`` (compress,
    cpu_attention). Raises PolicyError where some device fits no policy."""
    count = len(hardware)
    if count > config.num_layers:
        raise PolicyError(f"{count} pipeline stages are more than the {config.num_layers} layers of {config.name}")
    ranges = stage_ranges(config.num_layers, count)
    layers = [range_layers(owned, config.num_layers) for owned in ranges]
    share = stage_workload(workload, count, replicas)
    searched: dict[tuple, Prediction | None] = {}

    def best(stage: int, shape: tuple[int, int] | None) -> Prediction | None:
        """The device's best prediction, at a batch shape or any; None where it fits none."""
        key = (len(layers[stage]), hardware[stage], shape)
        if key not in searched:
            sizes = {} if shape is None else {"gpu_batch_sizes": [shape[0]], "num_gpu_batches": [shape[1]]}
            try:
                searched[key] = search_policy(stage_view(config, len(layers[stage])), share, hardware[stage],
                                              **options, **sizes).prediction
            except PolicyError:
                if shape is None:
                    raise
                searched[key] = None
        return searched[key]

    try:
        own = [best(stage, None) for stage in range(count)]
    except PolicyError as exc:
        raise PolicyError(f"a pipeline stage of {config.name} fits no policy: {exc}") from None
    plans = []
    for shape in dict.fromkeys((p.policy.gpu_batch_size, p.policy.num_gpu_batches) for p in own):
        predictions = [best(stage, shape) for stage in range(count)]
        if all(p is not None for p in predictions):
            plans.append(PipelinePlan(tuple(StagePlan(i, layers[i], hardware[i], p)
                                            for i, p in enumerate(predictions)), replicas))
    if not plans:
        raise PolicyError(f"the pipeline's stages of {config.name} fit no common batch shape")
    return max(plans, key=lambda plan: plan.throughput)
