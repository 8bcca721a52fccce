"""A job as the commands describe it: the model, where it runs, its policy and its sampling defaults.

Built once (from the command line, or in Python) and checked when built, so that whatever runs it
(``flexoff run``, the batch and bench harness) reads values that are already valid. Importing this
module loads no torch: a job can be described and refused before any model code is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import check_bool, check_device_name, check_int, check_real, check_seed, check_size
from .errors import ConfigError, PolicyError
from .fileio import check_offload_dir, offload_root
from .policy import CompressionConfig, TierFractions, check_choice, experts_from_percent, placement_from_percent

DEFAULT_MODEL = "opt-125m"  # what `flexoff run` alone runs, with dummy weights
# The longest wait for a parallel job's peers: torch.distributed's clocks count it in nanoseconds
# from now, and its rendezvous times out at once past about 9.2e9 s (timedelta holds 8.6e13 s).
MAX_PARALLEL_TIMEOUT_S = 10**9
# The names the API resolves (flexoff.deploy.devices.resolve_dtype); checked here so that a job is refused
# before torch is imported.
DTYPES = ("auto", "float16", "fp16", "half", "bfloat16", "bf16", "float32", "fp32")
POLICY_FLAGS = ("gpu_batch_size", "num_gpu_batches", "cpu_attention", "overlap", "pin_cpu_memory")


def stage_sizes(gpu_mem: str | None, stages: int) -> list[str | None]:
    """Each pipeline stage's GPU memory cap: ``gpu_mem`` (--gpu-mem) is one size for every GPU, or
    one per stage ("16GiB,24GiB"); None for none."""
    sizes = [size.strip() for size in gpu_mem.split(",")] if gpu_mem else [None]
    if len(sizes) not in (1, stages):
        raise ConfigError(f"--gpu-mem gives {len(sizes)} sizes for {stages} pipeline stage{'s' * (stages > 1)}: "
                          "give one size for every GPU, or one per stage")
    return sizes * stages if len(sizes) == 1 else sizes


def check_dtype_name(name: str) -> str:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; use auto, float16, bfloat16 or float32")
    return name


@dataclass(frozen=True)
class PolicySource:
    """Where the run's policy comes from: a file, ``"auto"`` (searched for the job on ``hardware``),
    or None (the library's default), with ``overrides`` (Policy fields) set on top. ``compress`` is
    what planning may do with lossy compression (one of policy.CHOICES); None means not given,
    which plans lossless."""

    file: str | None = None
    hardware: str | None = None  # the profile "auto" plans for: a packaged name or a profile file
    overrides: tuple[tuple[str, object], ...] = ()
    compress: str | None = None

    def __post_init__(self):
        if self.compress is not None:
            check_choice(self.compress, "compress")
        forced = [name for name, value in self.overrides
                  if name in ("compress_weight", "compress_cache") and value is not None]
        if self.compress == "off" and forced:
            flags = " and ".join("--" + name.replace("_", "-") for name in forced)
            raise PolicyError(f"{flags} compresses, which contradicts --compress off; drop one of them")

    @property
    def planning_compress(self) -> str:
        """What the planner may do with compression: lossless unless the user said otherwise."""
        return self.compress or "off"

    @property
    def searched(self) -> bool:
        return self.file == "auto"

    @classmethod
    def build(cls, file=None, hardware=None, *, percent=None, expert_percent=None,
              compress_weight: CompressionConfig | None = None,
              compress_cache: CompressionConfig | None = None, compress: str | None = None,
              **fields) -> "PolicySource":
        """From the policy flags: ``percent`` (FlexGen's six numbers), ``expert_percent`` (two, for a
        mixture of experts' expert weights), ``compress`` and the Policy
        fields in POLICY_FLAGS; None means not given."""
        unknown = set(fields) - set(POLICY_FLAGS)
        if unknown:
            raise PolicyError(f"unknown policy fields {sorted(unknown)}")
        overrides: dict[str, object] = {name: value for name, value in fields.items() if value is not None}
        if percent:
            overrides.update(placement_from_percent(tuple(percent)))
        if expert_percent:
            overrides["experts"] = experts_from_percent(tuple(expert_percent))
        if compress_weight is not None:
            overrides["compress_weight"] = compress_weight
        if compress_cache is not None:
            overrides["compress_cache"] = compress_cache
        return cls(file, hardware, tuple(overrides.items()), compress)


@dataclass(frozen=True)
class Job:
    """One job's model, device, policy, sampling defaults and memory caps, checked when built."""

    model: str = DEFAULT_MODEL
    dummy: bool = True
    dtype: str = "auto"  # one of DTYPES: auto is the model's own 16-bit format on CUDA, float32 on the CPU
    device: str = "auto"
    tokenizer: str | None = None
    seed: int = 0  # sampling and dummy weights
    policy: PolicySource = PolicySource()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    offload_dir: str | None = None
    gpu_mem: str | None = None  # sizes as given ("16GiB"); the API parses them
    cpu_mem: str | None = None
    # A parallel job's pipeline stages and replicas (None: from the launch; see flexoff.deploy.parallel),
    # and how long a process waits for its peers (None: flexoff.deploy.parallel's default).
    pipeline_parallel: int | None = None
    data_parallel: int | None = None
    parallel_timeout: float | None = None
    # Rows whose prompts begin alike share that prefix's prefill and cache (--no-prefix-sharing: off).
    prefix_sharing: bool = True
    # Decode layers run from CUDA graphs where the device can (--no-cuda-graphs: off).
    cuda_graphs: bool = True

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"model must be a name, a directory or a Hub id, got {self.model!r}")
        check_bool(self.dummy, "dummy")
        check_dtype_name(self.dtype)
        check_device_name(self.device)
        check_seed(self.seed, "seed", ConfigError)
        check_real(self.temperature, "temperature", ConfigError, 0)
        check_int(self.top_k, "top_k", ConfigError, 0)
        check_real(self.top_p, "top_p", ConfigError, above=0, maximum=1)
        object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(text, str) and text for text in self.stop):
            raise ConfigError(f"stop strings must be non-empty text, got {list(self.stop)!r}")
        check_bool(self.ignore_eos, "ignore_eos")
        check_bool(self.prefix_sharing, "prefix_sharing")
        check_bool(self.cuda_graphs, "cuda_graphs")
        if self.gpu_mem is not None:  # one size, or one per pipeline stage
            for size in self.gpu_mem.split(",") if isinstance(self.gpu_mem, str) else [self.gpu_mem]:
                check_size(size.strip() if isinstance(size, str) else size, "gpu_mem")
        if self.cpu_mem is not None:
            check_size(self.cpu_mem, "cpu_mem")
        for name in ("pipeline_parallel", "data_parallel"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, ConfigError, 1)
        if self.parallel_timeout is not None:
            check_real(self.parallel_timeout, "parallel_timeout", ConfigError, above=0, maximum=MAX_PARALLEL_TIMEOUT_S)
        check_offload_dir(self.offload_dir)
        for name, value in self.policy.overrides:
            if name in ("weights", "cache", "activations", "experts") and not isinstance(value, TierFractions):
                raise PolicyError(f"policy {name} must be TierFractions, got {value!r}")

    def stage_gpu_mem(self, stage: int = 0, stages: int = 1) -> str | None:
        """A pipeline stage's GPU memory cap (see stage_sizes)."""
        if not isinstance(self.gpu_mem, str):
            return self.gpu_mem
        return stage_sizes(self.gpu_mem, stages)[stage]

    @property
    def offload_root(self) -> str:
        """The folder the disk tier goes in (see fileio.offload_root)."""
        return offload_root(self.offload_dir)

    def sampling(self, max_new_tokens: int, stop: tuple[str, ...] = (), seed: int | None = None):
        """The job's sampling defaults for one prompt: its budget, and stop strings added to the job's."""
        from .runtime.sampling import SamplingParams

        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=seed, stop=self.stop + tuple(stop), ignore_eos=self.ignore_eos)
