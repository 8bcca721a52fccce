"""What the cost model and the search take apart from the hardware: the workload, the placement
fractions (the LP's variables) and the rest of a policy (the frame the search fixes before each LP)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..errors import ConfigError
from ..policy import CompressionConfig, Policy, TierFractions


@dataclass(frozen=True)
class Workload:
    """A batch job: every prompt padded to ``prompt_len``, each generating ``gen_len`` tokens.

    ``num_prompts`` None means an endless stream: no block is ever partly empty.
    """

    prompt_len: int
    gen_len: int
    num_prompts: int | None = None

    def __post_init__(self):
        for name in ("prompt_len", "gen_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name.replace('_', ' ')} must be an integer >= 1, got {value!r}")
        if self.num_prompts is not None and (not isinstance(self.num_prompts, int) or self.num_prompts < 1):
            raise ConfigError(f"number of prompts must be an integer >= 1, got {self.num_prompts!r}")


class Placement(NamedTuple):
    """The nine fractions, and ``cs``: the share of the whole cache that is on the CPU but travels
    to the GPU for attention although CPU attention is on (a part of ``cc``; the rest of the off-GPU
    cache is attended on the CPU). Each a float, or a numpy array to evaluate many placements at once.
    """

    wg: object
    wc: object
    wd: object
    cg: object
    cc: object
    cd: object
    hg: object
    hc: object
    hd: object
    cs: object = 0.0

    @classmethod
    def of(cls, policy: Policy) -> "Placement":
        shipped = policy.cache.cpu * (1 - policy.cpu_attention_split) if policy.cpu_attention else 0.0
        return cls(*policy.weights.as_tuple(), *policy.cache.as_tuple(), *policy.activations.as_tuple(), shipped)


@dataclass(frozen=True)
class PolicyFrame:
    """Everything in a Policy except the placement: what the search fixes before each LP."""

    gpu_batch_size: int
    num_gpu_batches: int
    compress_weight: CompressionConfig | None = None
    compress_cache: CompressionConfig | None = None
    cpu_attention: bool = False
    overlap: bool = True
    # With CPU attention, whether part of the CPU cache may travel to the GPU instead (Placement.cs);
    # such a frame keeps no cache on disk, which the runtime cannot split.
    split_cpu_attention: bool = False

    @property
    def block_size(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @classmethod
    def of(cls, policy: Policy) -> "PolicyFrame":
        return cls(policy.gpu_batch_size, policy.num_gpu_batches, policy.compress_weight,
                   policy.compress_cache, policy.cpu_attention, policy.overlap,
                   policy.cpu_attention and policy.cpu_attention_split < 1)

    def with_placement(self, fractions) -> Policy:
        """The policy of the nine fractions, and of ``cs`` (a tenth, 0 if absent) as the share of
        the CPU cache that CPU attention keeps."""
        f = [float(x) for x in fractions]
        shipped = f[9] if len(f) > 9 and self.cpu_attention else 0.0
        split = 1.0 if shipped <= 0 or f[4] <= 0 else round(max(0.0, 1 - shipped / f[4]), 6)
        return Policy(
            gpu_batch_size=self.gpu_batch_size, num_gpu_batches=self.num_gpu_batches,
            weights=TierFractions(*f[0:3]), cache=TierFractions(*f[3:6]), activations=TierFractions(*f[6:9]),
            cpu_attention=self.cpu_attention, cpu_attention_split=split, overlap=self.overlap,
            compress_weight=self.compress_weight, compress_cache=self.compress_cache,
        )
