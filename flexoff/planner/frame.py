"""What a prediction is about and what it says: the workload, the policy's frame and placement
(the nine fractions, floats or numpy arrays), and the predicted seconds and bytes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ..errors import ConfigError
from ..layout import requested_fractions
from ..models import ModelConfig, stage_specs, stages
from ..policy import TIERS, CompressionConfig, Policy, TierFractions


@dataclass(frozen=True)
class Workload:
    """A batch job: every prompt padded to ``prompt_len``, each generating ``gen_len`` tokens.

    ``num_prompts`` None means an endless stream: no block is ever partly empty. ``shared_prefix``:
    the tokens at the start of each prompt that the rows of its GPU batch share
    (``flexoff.prefixes``), prefilled, stored and moved once per GPU batch; 0 shares nothing.
    ``prefix_group``: how many prompts share each prefix (``flexoff.prefixes.job_prefix_group``), so
    that a GPU batch holds one prefix per group of its rows; 0 means all of a batch's rows share one.
    ``gen_lens``: each prompt's generation budget where they differ (none past ``gen_len``, the
    largest of the whole job where this is a share of it; empty: every prompt generates
    ``gen_len``). Memory is planned for ``gen_len``; the predicted throughput counts the tokens the
    budgets generate and retires each GPU batch once its budgets are spent, as the runtime does
    (``CostModel.retiring_throughput``). ``mean_prompt_len``: the prompts' mean length where they
    differ (0: every prompt is ``prompt_len`` long). Memory, the cache and the activations are
    planned padded to ``prompt_len``; the prefill's matmuls are priced at the mean, since blocks are
    formed by length and a GPU batch whose rows still pad runs them over its real positions alone
    (``runtime.packed_prefill``).
    """

    prompt_len: int
    gen_len: int
    num_prompts: int | None = None
    shared_prefix: int = 0
    prefix_group: int = 0
    gen_lens: tuple[int, ...] = field(default=(), repr=False)
    mean_prompt_len: float = 0.0

    def __post_init__(self):
        for name in ("prompt_len", "gen_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name.replace('_', ' ')} must be an integer >= 1, got {value!r}")
        if self.num_prompts is not None and (not isinstance(self.num_prompts, int) or self.num_prompts < 1):
            raise ConfigError(f"number of prompts must be an integer >= 1, got {self.num_prompts!r}")
        shared = self.shared_prefix
        if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared < self.prompt_len:
            raise ConfigError(f"shared prefix must be an integer from 0 to prompt length - 1 ({self.prompt_len - 1}), "
                              f"got {shared!r}")
        group = self.prefix_group
        if not isinstance(group, int) or isinstance(group, bool) or group < 0:
            raise ConfigError(f"prefix group must be an integer >= 0 (0: a GPU batch's rows all share one), "
                              f"got {group!r}")
        budgets = self.gen_lens
        if budgets:
            if not isinstance(budgets, tuple) or any(not isinstance(b, int) or isinstance(b, bool) or b < 1
                                                     for b in budgets):
                raise ConfigError(f"generation budgets must be a tuple of integers >= 1, got {budgets!r}")
            if max(budgets) > self.gen_len or len(budgets) != (self.num_prompts or len(budgets)):
                raise ConfigError(f"generation budgets must be one per prompt ({self.num_prompts}), none past "
                                  f"the generation length ({self.gen_len}), got {len(budgets)} up to {max(budgets)}")

        mean = self.mean_prompt_len
        numeric = isinstance(mean, (int, float)) and not isinstance(mean, bool)
        if not numeric or not (mean == 0 or 1 <= mean <= self.prompt_len):
            raise ConfigError(f"mean prompt length must be 0 (every prompt is the prompt length) or from 1 to the "
                              f"prompt length ({self.prompt_len}), got {mean!r}")

    @staticmethod
    def differing(budgets) -> tuple[int, ...]:
        """``gen_lens`` for a job of these budgets: all of them where they differ, else none."""
        budgets = tuple(budgets)
        return budgets if len(set(budgets)) > 1 else ()

    def with_generation(self, prompt_len: int, gen_len: int) -> "Workload":
        """This job with its prompts padded to ``prompt_len`` and no budget past ``gen_len``."""
        return replace(self, prompt_len=prompt_len, gen_len=min(self.gen_len, gen_len),
                       gen_lens=self.differing(min(b, gen_len) for b in self.gen_lens),
                       mean_prompt_len=min(self.mean_prompt_len, prompt_len))

    def with_prompts(self, num_prompts: int) -> "Workload":
        """A share of this job, ``num_prompts`` of its prompts, with budgets spread as the job's
        (every so many of them in order)."""
        ordered = sorted(self.gen_lens)
        return replace(self, num_prompts=num_prompts, gen_lens=self.differing(
            ordered[i * len(ordered) // num_prompts] for i in range(num_prompts)) if ordered else ())

    def _group_rows(self, gpu_batch_size: int) -> int:
        """The rows of a GPU batch that share each prefix."""
        return min(gpu_batch_size, self.prefix_group) if self.prefix_group else gpu_batch_size

    def batch_prefix(self, gpu_batch_size: int) -> int:
        """The prefix a GPU batch of ``gpu_batch_size`` rows shares: none where a group of its rows
        is one row, as ``flexoff.prefixes.batch_groups`` says."""
        return self.shared_prefix if self._group_rows(gpu_batch_size) > 1 else 0

    def prefix_rows(self, gpu_batch_size: int) -> int:
        """The prefixes a GPU batch of ``gpu_batch_size`` rows holds, a row each: one per group of
        ``prefix_group`` rows (the last may be smaller); 1 with none shared, where it counts nothing."""
        if not self.batch_prefix(gpu_batch_size):
            return 1
        return -(-gpu_batch_size // self._group_rows(gpu_batch_size))

    def batch_saved_tokens(self, gpu_batch_size: int) -> int:
        """Token positions a GPU batch's shared prefixes save: of its rows' copies of the prefix, all
        but one per prefix row."""
        return (gpu_batch_size - self.prefix_rows(gpu_batch_size)) * self.batch_prefix(gpu_batch_size)

    def block_prefill_positions(self, gpu_batch_size: int, num_gpu_batches: int) -> int:
        """Positions a block's prefill holds, padded: s per sequence, less what its batches' shared
        prefixes save. The cache's new slots and the activations are this many."""
        return num_gpu_batches * (self.prompt_len * gpu_batch_size - self.batch_saved_tokens(gpu_batch_size))

    def block_prefill_tokens(self, gpu_batch_size: int, num_gpu_batches: int) -> int:
        """Positions a block's prefill runs its matmuls over: the mean prompt's per sequence where
        the prompts differ (at least one a row, beside its batch's prefixes), less what shared
        prefixes save; never more than the padded positions."""
        padded = self.block_prefill_positions(gpu_batch_size, num_gpu_batches)
        if not self.mean_prompt_len:
            return padded
        saved = self.batch_saved_tokens(gpu_batch_size)
        floor = gpu_batch_size + self.prefix_rows(gpu_batch_size) * self.batch_prefix(gpu_batch_size)
        per_batch = max(floor, round(self.mean_prompt_len * gpu_batch_size) - saved)
        return min(padded, num_gpu_batches * per_batch)


class Placement(NamedTuple):
    """The nine fractions; each a float, or a numpy array to evaluate many placements at once."""

    wg: object
    wc: object
    wd: object
    cg: object
    cc: object
    cd: object
    hg: object
    hc: object
    hd: object

    @classmethod
    def of(cls, policy: Policy, config: ModelConfig) -> "Placement":
        """A policy's fractions; the weights' are all of ``config``'s weight elements on each tier,
        its experts counted at their own fractions where the policy places them apart."""
        weights = policy.weights.as_tuple()
        if policy.experts is not None:
            specs = [spec for stage in stages(config) for spec in stage_specs(config, stage)]
            share = requested_fractions(specs, policy.weights, policy.experts)
            weights = tuple(share[tier] for tier in TIERS)
        return cls(*weights, *policy.cache.as_tuple(), *policy.activations.as_tuple())


@dataclass(frozen=True)
class PolicyFrame:
    """Everything in a Policy except the placement: what the search fixes before each LP."""

    gpu_batch_size: int
    num_gpu_batches: int
    compress_weight: CompressionConfig | None = None
    compress_cache: CompressionConfig | None = None
    cpu_attention: bool = False
    overlap: bool = True

    @property
    def block_size(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @classmethod
    def of(cls, policy: Policy) -> "PolicyFrame":
        return cls(policy.gpu_batch_size, policy.num_gpu_batches, policy.compress_weight,
                   policy.compress_cache, policy.cpu_attention, policy.overlap)

    def with_placement(self, fractions) -> Policy:
        f = [float(x) for x in fractions]
        return Policy(
            gpu_batch_size=self.gpu_batch_size, num_gpu_batches=self.num_gpu_batches,
            weights=TierFractions(*f[0:3]), cache=TierFractions(*f[3:6]), activations=TierFractions(*f[6:9]),
            cpu_attention=self.cpu_attention, overlap=self.overlap,
            compress_weight=self.compress_weight, compress_cache=self.compress_cache,
        )


@dataclass(frozen=True)
class PhaseBreakdown:
    """Seconds per layer of one phase, term by term, and the term that bounds it."""

    phase: str
    io: dict  # stream (a link, or the host) -> seconds per layer
    compute: dict  # sub-term -> seconds per layer; they add up
    seconds_per_layer: float
    bound: str  # an IO term, or "compute (<largest sub-term>)"

    @property
    def compute_seconds(self) -> float:
        return sum(self.compute.values())


@dataclass(frozen=True)
class Prediction:
    policy: Policy
    workload: Workload
    prefill: PhaseBreakdown
    decode: PhaseBreakdown
    prefill_seconds: float  # one block
    decode_seconds: float  # one block
    block_latency: float  # seconds from a block's first prefill to its last token
    total_throughput: float  # generated tokens per second (FlexGen's generation throughput)
    prefill_throughput: float  # prompt tokens per second of prefill
    decode_throughput: float  # generated tokens per second of decode
    peak_memory: dict  # tier -> bytes
    capacity: dict  # tier -> usable bytes
    memory_by_phase: dict = field(default_factory=dict)  # (tier, phase) -> bytes
    disk_reads_cached: bool = False  # disk reads priced at the page-cache rate

    @property
    def fits(self) -> bool:
        return all(self.peak_memory[t] <= self.capacity[t] * (1 + 1e-9) for t in TIERS)

    @property
    def over_capacity(self) -> list[str]:
        return [t for t in TIERS if self.peak_memory[t] > self.capacity[t] * (1 + 1e-9)]

    @property
    def generated_token_weight(self) -> int:
        """What one generated token of a block costs in prompt tokens computed, as predicted (at
        least 1): block forming weighs a GPU batch's generation padding by it."""
        policy, workload = self.policy, self.workload
        steps = policy.block_size * (workload.gen_len - 1)
        computed = workload.block_prefill_tokens(policy.gpu_batch_size, policy.num_gpu_batches)
        if steps <= 0 or self.prefill_seconds <= 0 or self.decode_seconds <= 0:
            return 1
        return max(1, round((self.decode_seconds / steps) / (self.prefill_seconds / computed)))
