"""The policy: where weights, KV cache and activations live, batch sizes, and the run switches.

A Policy is frozen and validated on construction, so every consumer (placement, schedule,
cost model) can trust it. It round-trips through JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .checks import check_bool, check_int, check_real
from .errors import ArgumentTypeError, PolicyError
from .fileio import read_user_json, write_text_atomic

TIERS = ("gpu", "cpu", "disk")
SUPPORTED_BITS = (2, 3, 4, 8)
# What planning may do with an option of the policy (compression, CPU attention): never, try both, always.
CHOICES = ("off", "auto", "on")


def check_choice(value, what: str) -> str:
    if value not in CHOICES:
        raise PolicyError(f"{what} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


@dataclass(frozen=True)
class TierFractions:
    """Shares of one kind of data on each tier; they sum to 1."""

    gpu: float = 1.0
    cpu: float = 0.0
    disk: float = 0.0

    def __post_init__(self):
        self.validate("tier")

    def validate(self, what: str) -> None:
        for tier in TIERS:
            value = getattr(self, tier)
            check_real(value, f"{what} fraction on {tier}", PolicyError)
            if value < 0:
                raise PolicyError(f"{what} fraction on {tier} is negative ({value})")
        total = self.gpu + self.cpu + self.disk
        if abs(total - 1.0) > 1e-6:
            raise PolicyError(
                f"{what} fractions gpu/cpu/disk = {self.gpu}/{self.cpu}/{self.disk} sum to {total:g}, not 1"
            )

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.gpu, self.cpu, self.disk)

    @classmethod
    def from_percent(cls, gpu_percent: float, cpu_percent: float) -> "TierFractions":
        """FlexGen-style: gpu and cpu given in percent, disk takes the rest."""
        disk = 100.0 - gpu_percent - cpu_percent
        if abs(disk) < 1e-9:
            disk = 0.0
        return cls(gpu_percent / 100.0, cpu_percent / 100.0, disk / 100.0)


def placement_from_percent(percent, flag: str = "--percent") -> dict[str, TierFractions]:
    """FlexGen's ``--percent``: weights, cache and activations on gpu and cpu (six numbers, the rest
    on disk), as Policy's ``weights``, ``cache`` and ``activations`` arguments. ``flag`` names the
    six numbers in messages."""
    if not isinstance(percent, (list, tuple)) or len(percent) != 6:
        raise ArgumentTypeError(f"{flag} takes six numbers (W_GPU W_CPU C_GPU C_CPU A_GPU A_CPU), got {percent!r}")
    for name, gpu, cpu in zip(("weights", "cache", "activations"), percent[0::2], percent[1::2]):
        for tier, value in (("gpu", gpu), ("cpu", cpu)):
            check_real(value, f"{flag}: {name} on {tier}", PolicyError, 0, 100)
        if gpu + cpu > 100 + 1e-9:
            raise PolicyError(f"{flag}: {name} on gpu and cpu add up to {gpu + cpu:g}%, more than 100 "
                              "(the rest goes to disk)")
    w_gpu, w_cpu, c_gpu, c_cpu, a_gpu, a_cpu = percent
    return {"weights": TierFractions.from_percent(w_gpu, w_cpu), "cache": TierFractions.from_percent(c_gpu, c_cpu),
            "activations": TierFractions.from_percent(a_gpu, a_cpu)}


def experts_from_percent(percent, flag: str = "--expert-percent") -> TierFractions:
    """A mixture of experts' expert weights on gpu and cpu in percent (the rest on disk), as Policy's
    ``experts``."""
    if not isinstance(percent, (list, tuple)) or len(percent) != 2:
        raise ArgumentTypeError(f"{flag} takes two numbers (GPU CPU), got {percent!r}")
    for tier, value in zip(("gpu", "cpu"), percent):
        check_real(value, f"{flag}: experts on {tier}", PolicyError, 0, 100)
    if sum(percent) > 100 + 1e-9:
        raise PolicyError(f"{flag}: experts on gpu and cpu add up to {sum(percent):g}%, more than 100 "
                          "(the rest goes to disk)")
    return TierFractions.from_percent(*percent)


# Far past any real batch or group, and small enough that the sizes computed from them stay within
# the 64-bit shapes torch takes.
MAX_BATCH = 2**20
MAX_GROUP = 2**20


@dataclass(frozen=True)
class CompressionConfig:
    """Group-wise asymmetric quantization settings."""

    bits: int = 4
    group_size: int = 64

    def __post_init__(self):
        self.validate("compression")

    def validate(self, what: str) -> None:
        check_int(self.bits, f"{what} bits", PolicyError)
        if self.bits not in SUPPORTED_BITS:
            raise PolicyError(f"{what}: {self.bits}-bit compression is not supported; use one of {SUPPORTED_BITS}")
        check_int(self.group_size, f"{what} group size", PolicyError, minimum=2, maximum=MAX_GROUP)


@dataclass(frozen=True)
class Policy:
    gpu_batch_size: int = 1
    num_gpu_batches: int = 1
    weights: TierFractions = field(default_factory=TierFractions)
    cache: TierFractions = field(default_factory=TierFractions)
    activations: TierFractions = field(default_factory=TierFractions)
    cpu_attention: bool = False
    overlap: bool = True
    pin_cpu_memory: bool = True
    compress_weight: CompressionConfig | None = None
    compress_cache: CompressionConfig | None = None
    # A mixture of experts' expert weights, placed apart from the rest (None: as ``weights``). Experts
    # stay whole, so a fraction is met to the nearest expert of each layer.
    experts: TierFractions | None = None

    def __post_init__(self):
        for name in ("gpu_batch_size", "num_gpu_batches"):
            check_int(getattr(self, name), name, PolicyError, minimum=1, maximum=MAX_BATCH)
        for name in ("cpu_attention", "overlap", "pin_cpu_memory"):
            check_bool(getattr(self, name), name)
        for name in ("weights", "cache", "activations"):
            if not isinstance(getattr(self, name), TierFractions):
                raise ArgumentTypeError(f"{name} must be a TierFractions, got {type(getattr(self, name)).__name__}")
        if self.experts is not None and not isinstance(self.experts, TierFractions):
            raise ArgumentTypeError(f"experts must be a TierFractions or None, got {type(self.experts).__name__}")
        for name in ("compress_weight", "compress_cache"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, CompressionConfig):
                raise ArgumentTypeError(f"{name} must be a CompressionConfig or None, got {type(value).__name__}")
        self.weights.validate("weight")
        self.cache.validate("cache")
        self.activations.validate("activation")
        if self.experts is not None:
            self.experts.validate("expert")

    @property
    def expert_fractions(self) -> TierFractions:
        """Where expert weights go: their own fractions, else the weights'."""
        return self.experts if self.experts is not None else self.weights

    @property
    def block_size(self) -> int:
        """Sequences processed together: one weight load serves all of them."""
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def uses_disk(self) -> bool:
        return any(f.disk > 0 for f in (self.weights, self.cache, self.activations, self.expert_fractions))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        write_text_atomic(Path(path), self.to_json())

    @classmethod
    def from_dict(cls, data: dict, source: str = "policy") -> "Policy":
        if not isinstance(data, dict):
            raise PolicyError(f"{source}: a policy must be a JSON object")
        _refuse_unknown(cls, data, f"{source}: unknown policy field")
        kwargs = dict(data)
        try:
            for name in ("weights", "cache", "activations", "experts"):
                if kwargs.get(name) is not None:
                    kwargs[name] = _sub(TierFractions, kwargs[name], name)
            for name in ("compress_weight", "compress_cache"):
                if kwargs.get(name) is not None:
                    kwargs[name] = _sub(CompressionConfig, kwargs[name], name)
            return cls(**kwargs)
        except (ArgumentTypeError, PolicyError) as exc:
            # In a file, a value of the wrong type is a bad policy like any other; name the file.
            raise PolicyError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Policy":
        return cls.from_dict(read_user_json(path, "policy file", PolicyError), source=str(path))


def _sub(kind, value, name: str):
    if not isinstance(value, dict):
        raise PolicyError(f"{name} must be a JSON object, got {value!r}")
    _refuse_unknown(kind, value, f"{name}: unknown field")
    try:
        return kind(**value)
    except (ArgumentTypeError, PolicyError) as exc:
        raise PolicyError(f"{name}: {exc}") from None


def _refuse_unknown(kind, data: dict, what: str) -> None:
    """A field ``kind`` does not have is a typo the user should hear about, not a silent default."""
    known = sorted(f.name for f in fields(kind))
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise PolicyError(f"{what} {unknown[0]!r}; known fields: {', '.join(known)}")
