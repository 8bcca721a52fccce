"""The metrics record of a run: time per phase, padded vs actual tokens, and peak memory per tier."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import psutil
import torch


@dataclass
class Metrics:
    """Throughputs follow FlexGen's definitions: decode excludes the token the prefill produced,
    total counts every generated token over the whole time. Padded counts include left padding
    and the steps a finished sequence still occupies in its batch."""

    prefill_time: float = 0.0
    decode_time: float = 0.0
    num_sequences: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    padded_prompt_tokens: int = 0
    padded_generated_tokens: int = 0
    # Prompt tokens whose prefill and cache a GPU batch's rows shared: counted once, not per row.
    shared_prompt_tokens: int = 0
    peak_memory: dict[str, int] = field(default_factory=dict)

    @property
    def total_time(self) -> float:
        return self.prefill_time + self.decode_time

    @property
    def prefill_throughput(self) -> float:
        return self.prompt_tokens / self.prefill_time if self.prefill_time else 0.0

    @property
    def decode_throughput(self) -> float:
        decoded = self.generated_tokens - self.num_sequences
        return decoded / self.decode_time if self.decode_time else 0.0

    @property
    def total_throughput(self) -> float:
        return self.generated_tokens / self.total_time if self.total_time else 0.0

    @property
    def actual_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    @property
    def padded_tokens(self) -> int:
        return self.padded_prompt_tokens + self.padded_generated_tokens

    @property
    def actual_throughput(self) -> float:
        return self.actual_tokens / self.total_time if self.total_time else 0.0

    @property
    def padded_throughput(self) -> float:
        return self.padded_tokens / self.total_time if self.total_time else 0.0

    @property
    def efficiency(self) -> float:
        return self.actual_tokens / self.padded_tokens if self.padded_tokens else 1.0

    def add(self, other: "Metrics") -> None:
        """Accumulate another block's counts and times; peaks take the maximum."""
        for name in ("prefill_time", "decode_time", "num_sequences", "prompt_tokens", "generated_tokens",
                     "padded_prompt_tokens", "padded_generated_tokens", "shared_prompt_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for tier, value in other.peak_memory.items():
            self.peak_memory[tier] = max(self.peak_memory.get(tier, 0), value)

    @classmethod
    def concurrent(cls, blocks: list["Metrics"]) -> "Metrics":
        """Blocks that ran at the same time (in rotation, or on replicas) as one span: their counts
        added, and their phases from the start to the last prefill's end, then to the last end."""
        span = cls()
        for metrics in blocks:
            span.add(metrics)
        span.prefill_time = max((m.prefill_time for m in blocks), default=0.0)
        span.decode_time = max((m.total_time for m in blocks), default=0.0) - span.prefill_time
        return span

    def to_dict(self) -> dict:
        return {
            "prefill_time": self.prefill_time, "decode_time": self.decode_time, "total_time": self.total_time,
            "num_sequences": self.num_sequences, "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens, "padded_prompt_tokens": self.padded_prompt_tokens,
            "padded_generated_tokens": self.padded_generated_tokens, "shared_prompt_tokens": self.shared_prompt_tokens,
            "prefill_throughput": self.prefill_throughput, "decode_throughput": self.decode_throughput,
            "total_throughput": self.total_throughput, "actual_throughput": self.actual_throughput,
            "padded_throughput": self.padded_throughput, "efficiency": self.efficiency,
            "peak_memory": dict(self.peak_memory),
        }


class Meter(Protocol):
    """Memory as a block reads and records it."""

    extra: dict[str, int]  # peaks measured elsewhere, by name, reported with the others

    def sample(self) -> None:
        """Measure now: called at phase boundaries, where the working set is largest."""

    def peaks(self) -> dict[str, int]:
        """Peak bytes by tier, and the extra ones."""


class MemoryMeter:
    """Peak memory per tier: CUDA's allocator peak, the process's resident set, and what ``held``
    tells (bytes held outside both counts, such as the host's weights and the disk's files)."""

    def __init__(self, device: torch.device, held: Callable[[], dict[str, int]] = dict):
        self.device = device
        self.held = held
        self._process = psutil.Process()
        self._cpu_peak = 0
        self.extra: dict[str, int] = {}

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._cpu_peak = 0
        self.sample()

    def sample(self) -> None:
        """Read RSS now."""
        self._cpu_peak = max(self._cpu_peak, self._process.memory_info().rss)

    def peaks(self) -> dict[str, int]:
        self.sample()
        peaks = {"cpu_rss": self._cpu_peak}
        if self.device.type == "cuda":
            peaks["gpu"] = torch.cuda.max_memory_allocated(self.device)
            # What the card had to hold: blocks freed while a side stream still reads them stay
            # reserved (record_stream), and the allocator's rounding and segments count too.
            peaks["gpu_reserved"] = torch.cuda.max_memory_reserved(self.device)
        peaks.update(self.extra)
        peaks.update(self.held())
        return peaks
