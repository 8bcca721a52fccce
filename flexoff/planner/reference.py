"""The reference policies in ``policies/`` and the FlexGen paper's hand-tuned T4 policies.

``python -m flexoff.commands.reference [DIR]`` regenerates ``policies/`` (default: ./policies);
a test checks that the checked-in files still match what the search finds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..fileio import write_text_atomic
from ..models import REGISTRY
from ..policy import CompressionConfig, Policy, TierFractions
from ..units import format_size
from .cost_model import Workload
from .hardware import packaged_profile
from .report import policy_summary
from .search import SearchResult, search_policy

BENCHMARK_WORKLOAD = Workload(prompt_len=512, gen_len=32)
_FOUR_BIT = CompressionConfig(bits=4, group_size=64)


@dataclass(frozen=True)
class PaperPolicy:
    """A policy the FlexGen paper tuned by hand on its T4 machine, with the throughput it measured."""

    model: str
    policy: Policy
    measured_throughput: float  # token/s, prompt 512, generate 32


def _paper(gbs, batches, wg, wc, cg, cc, hg, hc, cpu_attention, compressed=False) -> Policy:
    compression = _FOUR_BIT if compressed else None
    return Policy(gpu_batch_size=gbs, num_gpu_batches=batches, weights=TierFractions.from_percent(wg, wc),
                  cache=TierFractions.from_percent(cg, cc), activations=TierFractions.from_percent(hg, hc),
                  cpu_attention=cpu_attention, compress_weight=compression, compress_cache=compression)


# Table 15 of the paper (prompt 512); CPU attention is on for fp16 and off with compression (§5).
PAPER_T4_POLICIES = {
    "opt-30b": PaperPolicy("opt-30b", _paper(48, 3, 20, 80, 0, 100, 0, 100, True), 7.32),
    "opt-175b": PaperPolicy("opt-175b", _paper(32, 8, 0, 50, 0, 0, 0, 100, True), 0.69),
    "opt-30b-4bit": PaperPolicy("opt-30b", _paper(16, 20, 20, 80, 0, 100, 100, 0, False, True), 8.70),
    "opt-175b-4bit": PaperPolicy("opt-175b", _paper(48, 3, 0, 100, 0, 100, 0, 100, False, True), 1.12),
}


@dataclass(frozen=True)
class ReferenceSearch:
    filename: str
    model: str
    hardware: str
    compress: str  # "off" for fp16, "on" for 4-bit


REFERENCE_SEARCHES = (
    ReferenceSearch("opt-30b.t4.json", "opt-30b", "t4", "off"),
    ReferenceSearch("opt-30b-4bit.t4.json", "opt-30b", "t4", "on"),
    ReferenceSearch("opt-175b.t4.json", "opt-175b", "t4", "off"),
    ReferenceSearch("opt-175b-4bit.t4.json", "opt-175b", "t4", "on"),
    ReferenceSearch("opt-30b.h100.json", "opt-30b", "h100", "off"),
    ReferenceSearch("opt-66b.h100.json", "opt-66b", "h100", "off"),
    ReferenceSearch("opt-175b-4bit.h100.json", "opt-175b", "h100", "on"),
)


def run_reference_search(spec: ReferenceSearch) -> SearchResult:
    return search_policy(REGISTRY[spec.model], BENCHMARK_WORKLOAD, packaged_profile(spec.hardware),
                         compress=spec.compress)


def write_reference_policies(directory: str | Path) -> dict[str, SearchResult]:
    directory = Path(directory)
    results = {}
    lines = [
        "# Reference policies",
        "",
        "Searched by `python -m flexoff.commands.reference` for prompt 512, generate 32, on the packaged",
        "hardware profiles (`t4`: the FlexGen paper's machine; `h100`: the lent H100 machine).",
        "Use one with `flexoff run --policy policies/FILE`. The figures are the cost model's predictions.",
        "",
        "| file | model | profile | policy | token/s | block latency (s) | decode bound | peak gpu / cpu / disk |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for spec in REFERENCE_SEARCHES:
        result = run_reference_search(spec)
        results[spec.filename] = result
        result.policy.save(directory / spec.filename)
        peak = " / ".join(format_size(result.prediction.peak_memory[t]) for t in ("gpu", "cpu", "disk"))
        lines.append(f"| {spec.filename} | {spec.model} | {spec.hardware} | {policy_summary(result.policy)} | "
                     f"{result.throughput:.4g} | {result.latency:.4g} | {result.prediction.decode.bound} | {peak} |")
    write_text_atomic(directory / "README.md", "\n".join(lines) + "\n")
    return results

