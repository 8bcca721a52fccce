"""Readable and machine-readable views of predictions: tables, CSV, and a frontier plot."""

from __future__ import annotations

import csv
from pathlib import Path

from ..errors import ConfigError
from ..policy import TIERS, Policy
from ..units import format_size
from .cost_model import Prediction
from .hardware import HardwareProfile


def _percent(fractions) -> str:
    return " / ".join(f"{100 * v:.4g}%" for v in fractions.as_tuple())


def _compression(policy: Policy) -> str:
    parts = []
    for what, config in (("weights", policy.compress_weight), ("cache", policy.compress_cache)):
        if config is not None:
            parts.append(f"{what} {config.bits}-bit g{config.group_size}")
    return ", ".join(parts) or "off"


def policy_summary(policy: Policy) -> str:
    """One line: '48x3 w 0/100/0 c 0/100/0 a 0/100/0 cpu-att 4-bit'."""
    def short(fractions):
        return "/".join(f"{100 * v:.3g}" for v in fractions.as_tuple())
    flags = []
    if policy.cpu_attention:
        flags.append("cpu-attention")
    if policy.compress_weight or policy.compress_cache:
        flags.append(f"{(policy.compress_weight or policy.compress_cache).bits}-bit")
    return (f"{policy.gpu_batch_size}x{policy.num_gpu_batches} w {short(policy.weights)} "
            f"c {short(policy.cache)} a {short(policy.activations)}" + "".join(f" {f}" for f in flags))


def format_prediction(prediction: Prediction, title: str = "") -> str:
    policy = prediction.policy
    rows = [
        ("policy", ""),
        ("  gpu batch size x batches", f"{policy.gpu_batch_size} x {policy.num_gpu_batches} "
                                       f"(block of {policy.block_size})"),
        ("  weights gpu/cpu/disk", _percent(policy.weights)),
        ("  kv cache gpu/cpu/disk", _percent(policy.cache)),
        ("  activations gpu/cpu/disk", _percent(policy.activations)),
        ("  compression", _compression(policy)),
        ("  cpu attention", "on" if policy.cpu_attention else "off"),
        ("  overlap", "on" if policy.overlap else "off"),
        ("prediction", ""),
        ("  throughput", f"{prediction.total_throughput:.4g} token/s generated "
                         f"(prefill {prediction.prefill_throughput:.4g}, "
                         f"decode {prediction.decode_throughput:.4g} token/s)"),
        ("  block latency", f"{prediction.block_latency:.4g} s (prefill {prediction.prefill_seconds:.4g} s, "
                            f"decode {prediction.decode_seconds:.4g} s)"),
        ("  prefill bound by", prediction.prefill.bound),
        ("  decode bound by", prediction.decode.bound),
    ]
    width = max(len(label) for label, _ in rows) + 2
    lines = [title] if title else []
    lines += [f"{label:<{width}}{value}".rstrip() for label, value in rows]
    lines.append(f"{'memory':<{width}}{'peak':>12}  {'usable':>12}  {'used':>5}")
    for tier in TIERS:
        peak, usable = prediction.peak_memory[tier], prediction.capacity[tier]
        share = f"{100 * peak / usable:.0f}%" if usable else "-"
        lines.append(f"{'  ' + tier:<{width}}{format_size(peak):>12}  {format_size(usable):>12}  {share:>5}")
    return "\n".join(lines)


FRONTIER_COLUMNS = ("block_latency_s", "throughput_token_per_s", "gpu_batch_size", "num_gpu_batches",
                    "weights_gpu", "weights_cpu", "weights_disk", "cache_gpu", "cache_cpu", "cache_disk",
                    "activations_gpu", "activations_cpu", "activations_disk", "compression", "cpu_attention",
                    "decode_bound")


def frontier_rows(predictions: list[Prediction]) -> list[dict]:
    rows = []
    for prediction in predictions:
        policy = prediction.policy
        row = {"block_latency_s": prediction.block_latency, "throughput_token_per_s": prediction.total_throughput,
               "gpu_batch_size": policy.gpu_batch_size, "num_gpu_batches": policy.num_gpu_batches}
        for what in ("weights", "cache", "activations"):
            for tier, value in zip(TIERS, getattr(policy, what).as_tuple()):
                row[f"{what}_{tier}"] = value
        row["compression"] = _compression(policy)
        row["cpu_attention"] = policy.cpu_attention
        row["decode_bound"] = prediction.decode.bound
        rows.append(row)
    return rows


def format_frontier(predictions: list[Prediction]) -> str:
    lines = [f"{'latency (s)':>12}  {'token/s':>10}  policy (gbs x batches, w/c/a gpu/cpu/disk %)  decode bound"]
    for prediction in predictions:
        lines.append(f"{prediction.block_latency:>12.4g}  {prediction.total_throughput:>10.4g}  "
                     f"{policy_summary(prediction.policy)}  {prediction.decode.bound}")
    return "\n".join(lines)


def write_frontier_csv(predictions: list[Prediction], path: str | Path) -> None:
    try:
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=FRONTIER_COLUMNS)
            writer.writeheader()
            writer.writerows(frontier_rows(predictions))
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None


def plot_frontier(predictions: list[Prediction], path: str | Path, title: str = "") -> None:
    """Save the latency-throughput frontier as an image (matplotlib is imported only here)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    draw_frontier(ax, predictions, title)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot write plot {path}: {exc}") from None
    finally:
        plt.close(fig)


def draw_frontier(ax, predictions: list[Prediction], title: str = "", label: str | None = None) -> None:
    latencies = [p.block_latency for p in predictions]
    throughputs = [p.total_throughput for p in predictions]
    ax.plot(latencies, throughputs, marker="o", drawstyle="steps-post", label=label)
    # Label about ten points, always including the fastest and the highest-throughput ones.
    step = max(1, len(predictions) // 10)
    for i, p in enumerate(predictions):
        if i % step == 0 or i == len(predictions) - 1:
            ax.annotate(f"{p.policy.gpu_batch_size}x{p.policy.num_gpu_batches}",
                        (p.block_latency, p.total_throughput), textcoords="offset points", xytext=(4, -10),
                        fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("block latency (s)")
    ax.set_ylabel("generation throughput (token/s)")
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)


def describe_hardware(hardware: HardwareProfile) -> str:
    caps = ", ".join(f"{t} {format_size(hardware.capacity(t))}" for t in TIERS)
    return f"{hardware.name} ({caps} usable)"
