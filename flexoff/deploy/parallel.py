"""A job over several processes, on torch.distributed: pipelines of stages (each process a
contiguous range of the model's layers, on its own GPU) and replicas of the pipeline (data
parallelism). Processes are started by torchrun (or ``torch.distributed.run``, which ``flexoff
run --pipeline-parallel`` calls), which sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE.

Rank r is stage r % S of replica r // S. Every process reads the same prompts and forms the same
blocks; replicas take turns at groups of S blocks (one per stage, in rotation), and after each
round every process learns every block's results, so that each reports the same outputs (rank 0
writes them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..checks import check_int
from ..errors import ConfigError, FlexoffError
from ..layout.stage_split import check_counts, range_layers, stage_ranges, stage_view

# How long a process waits for a peer before the job ends (a rank that died, a stuck collective).
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process."""

    rank: int
    world: int
    local_rank: int
    local_world: int

    @classmethod
    def from_env(cls, environ=os.environ) -> "Launch | None":
        """None outside a launcher (no RANK and WORLD_SIZE)."""
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return None
        try:
            rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
            local_rank = int(environ.get("LOCAL_RANK", rank))
            local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
        except ValueError:
            raise ConfigError("RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers, as torchrun "
                              "sets them") from None
        if not 0 <= rank < world or not 0 <= local_rank < local_world:
            raise ConfigError(f"RANK={rank} of WORLD_SIZE={world} (LOCAL_RANK={local_rank} of {local_world}) is "
                              "not a place in the job")
        return cls(rank, world, local_rank, local_world)


@dataclass(frozen=True)
class Parallel:
    """How many pipeline stages and replicas; None: as many stages as the launch has processes
    (over the replicas), one replica."""

    pipeline: int | None = None
    data: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    layers: tuple[int, ...] | None = None  # decoder layers of each stage (None: split evenly)

    def __post_init__(self):
        for name, value in (("pipeline_parallel_size", self.pipeline), ("data_parallel_size", self.data)):
            if value is not None:
                check_int(value, name, ConfigError, 1)

    @property
    def asked(self) -> int:
        """Processes the sizes given ask for (1 where none is)."""
        return (self.pipeline or 1) * (self.data or 1)

    def resolved(self, launch: Launch | None) -> "Parallel":
        """Both sizes, the missing one from the launch's processes."""
        world = launch.world if launch is not None else self.asked
        data = self.data or (world // self.pipeline if self.pipeline and world % self.pipeline == 0 else 1)
        pipeline = self.pipeline or max(1, world // data)
        return Parallel(pipeline, data, self.timeout_s, self.layers)


def check_parallel(parallel: Parallel, num_layers: int, model: str, launch: Launch | None,
                   device: torch.device) -> None:
    """Refuse a parallel job that cannot run, before any weight is loaded. ``parallel`` is resolved."""
    if parallel.pipeline > num_layers:
        raise ConfigError(f"--pipeline-parallel {parallel.pipeline} is more than the {num_layers} layers of "
                          f"{model}: each stage needs at least one")
    if parallel.layers is not None:
        check_counts(parallel.layers, num_layers, parallel.pipeline)
    size = parallel.pipeline * parallel.data
    if launch is None:
        raise FlexoffError(f"{parallel.pipeline} pipeline stages x {parallel.data} replicas need {size} processes: "
                           f"start them with `torchrun --nproc-per-node {size} ...`, or use flexoff run/batch "
                           "--pipeline-parallel, which starts them")
    if launch.world != size:
        raise ConfigError(f"the job has {launch.world} processes, but {parallel.pipeline} pipeline stages x "
                          f"{parallel.data} replicas make {size}")
    if device.type == "cuda":
        if device.index is not None:
            raise ConfigError(f"device {device} names one GPU, but each process of a parallel job runs on the GPU of "
                              "its local rank: pass device cuda or auto")
        visible = torch.cuda.device_count()
        if launch.local_world > visible:
            raise ConfigError(f"{launch.local_world} processes on this host, but only {visible} GPUs are visible "
                              "to it: start at most one per GPU")


class Ranks:
    """This process's place in a parallel job."""

    def __init__(self, parallel: Parallel, launch: Launch, num_layers: int, device: torch.device):
        from ..runtime.pipeline import PipelinePlace

        self.parallel = parallel
        self.launch = launch
        self.num_layers = num_layers
        self.replica, self.stage = divmod(launch.rank, parallel.pipeline)
        first = self.replica * parallel.pipeline
        self.place = PipelinePlace(self.stage, stage_ranges(num_layers, parallel.pipeline, parallel.layers),
                                   tuple(range(first, first + parallel.pipeline)))
        self.device = torch.device("cuda", launch.local_rank) if device.type == "cuda" else device

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def reports(self) -> bool:
        """Whether this process holds the results of the blocks its replica runs (its first stage)."""
        return self.place.first

    def with_layers(self, layers: tuple[int, ...]) -> "Ranks":
        """This process's place once the stages' layers are planned (``layers``: decoder layers of
        each stage); the process group it joined stays."""
        check_counts(layers, self.num_layers, self.parallel.pipeline)
        parallel = Parallel(self.parallel.pipeline, self.parallel.data, self.parallel.timeout_s, tuple(layers))
        return Ranks(parallel, self.launch, self.num_layers, self.device)

    def join(self) -> None:
        """Join the job's process group (NCCL between GPUs, gloo between CPUs; once a process: the
        group lives until it exits), then check that every process computes on the same kind of
        device."""
        import atexit

        import torch.distributed as dist

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    timeout=timedelta(seconds=self.parallel.timeout_s),
                                    device_id=self.device if self.device.type == "cuda" else None)
            atexit.register(_leave)
        kinds = self.gather(self.device.type)
        if len(set(kinds)) > 1:
            where = ", ".join(f"rank {rank}: {kind}" for rank, kind in enumerate(kinds))
            raise ConfigError(f"the processes of a parallel job must compute on one kind of device ({where})")

    def gather(self, value) -> list:
        """``value`` of every process, in rank order."""
        import torch.distributed as dist

        values = [None] * self.launch.world
        dist.all_gather_object(values, value)
        return values

    def on_rank0(self, make):
        """``make()`` run on rank 0 and its value given to every process; a user error there is
        raised everywhere, so that no process waits for the others."""
        import torch.distributed as dist

        box = [None]
        if self.rank == 0:
            try:
                box[0] = make()
            except FlexoffError as exc:
                box[0] = exc
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], FlexoffError):
            if self.rank != 0:
                box[0].said_by_rank0 = True  # rank 0 prints it; the others end without a word
            raise box[0]
        return box[0]

    def largest_stage(self, config):
        """The model as the pipeline's largest stage holds it (every stage runs the policy planned
        for it: a pipeline's stages must agree on batch sizes)."""
        return stage_view(config, max(len(range_layers(r, config.num_layers)) for r in self.place.ranges))

    def my_blocks(self, group: list[list[int]]) -> list[int]:
        """Of a round (each replica's blocks), those this process runs."""
        return group[self.replica] if self.replica < len(group) else []


def rounds(num_blocks: int, pipeline: int, data: int) -> list[list[list[int]]]:
    """The job's blocks as rounds: in each, every replica runs up to ``pipeline`` consecutive
    blocks in rotation. Blocks are formed by length, so a round's replicas get blocks alike."""
    groups = [list(range(start, min(start + pipeline, num_blocks))) for start in range(0, num_blocks, pipeline)]
    return [groups[start:start + data] for start in range(0, len(groups), data)]


def checked_device(parallel: Parallel, config, launch: Launch | None, device: str | torch.device) -> torch.device:
    """The kind of device a parallel job computes on, once the job's shape is checked for it
    (``parallel`` resolved), before any weight is loaded."""
    from .devices import parse_device, resolve_device

    resolve_device(device)  # refuses CUDA where there is none
    asked = parse_device(device) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_parallel(parallel, config.num_layers, config.name, launch, asked)
    return asked


def parallel_ranks(parallel: Parallel, config, device: str | torch.device) -> Ranks | None:
    """This process's place in the parallel job it belongs to, joined; None when it runs alone."""
    launch = Launch.from_env()
    parallel = parallel.resolved(launch)
    if parallel.pipeline * parallel.data == 1:
        return None
    asked = checked_device(parallel, config, launch, device)
    ranks = Ranks(parallel, launch, config.num_layers, asked)
    ranks.join()
    return ranks


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
