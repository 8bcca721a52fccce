"""What the commands show: predictions as tables, CSV and a frontier plot, a run's summary, and the
progress of a hardware profile being measured."""

from __future__ import annotations

import csv
import io
import math
import sys
from pathlib import Path

from ..errors import ConfigError
from ..fileio import write_bytes_atomic, write_text_atomic
from ..layout.stage_split import range_layers
from ..planner.cost_model import Prediction
from ..planner.hardware import HardwareProfile
from ..planner.report import policy_summary
from ..policy import TIERS, CompressionConfig, Policy
from ..units import format_size


def warning_line(text: str) -> str:
    """A warning as every command prints it on stderr (errors are ``flexoff: error: ...``)."""
    return f"flexoff: warning: {text}"


def _percent(fractions) -> str:
    return " / ".join(f"{100 * v:.4g}%" for v in fractions.as_tuple())


def _compression(policy: Policy, stored: CompressionConfig | None = None) -> str:
    """'weights 4-bit g64, cache 4-bit g64'; weights read in ``stored``, the format the checkpoint
    stores them in, are marked 'as stored'."""
    parts = []
    for what, config in (("weights", policy.compress_weight), ("cache", policy.compress_cache)):
        if config is not None:
            parts.append(f"{what} {config.bits}-bit g{config.group_size}"
                         + (" as stored" if what == "weights" and config == stored else ""))
    return ", ".join(parts) or "off"


def format_prediction(prediction: Prediction, title: str = "", stored: CompressionConfig | None = None) -> str:
    """A prediction as a table; ``stored``: the model's stored format (``ModelConfig.stored_compression``)."""
    policy = prediction.policy
    rows = [
        ("policy", ""),
        ("  gpu batch size x batches", f"{policy.gpu_batch_size} x {policy.num_gpu_batches} "
                                       f"(block of {policy.block_size})"),
        ("  weights gpu/cpu/disk", _percent(policy.weights)),
        *([("  experts gpu/cpu/disk", _percent(policy.experts))] if policy.experts is not None else []),
        ("  kv cache gpu/cpu/disk", _percent(policy.cache)),
        ("  activations gpu/cpu/disk", _percent(policy.activations)),
        ("  compression", _compression(policy, stored)),
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
    """The frontier as CSV, written whole or not at all (a full disk leaves no empty file)."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=FRONTIER_COLUMNS)
    writer.writeheader()
    writer.writerows(frontier_rows(predictions))
    try:
        write_text_atomic(path, text.getvalue())
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None


def plot_frontier(predictions: list[Prediction], path: str | Path, title: str = "") -> None:
    """Save the latency-throughput frontier as an image (matplotlib is imported only here), whole
    or not at all; its format is the file's extension, PNG without one."""
    fig = frontier_figure(predictions, title)
    image = io.BytesIO()
    try:
        fig.savefig(image, format=Path(path).suffix[1:] or "png")
        write_bytes_atomic(path, image.getvalue())
    except OSError as exc:
        raise ConfigError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a format matplotlib does not write
        raise ConfigError(f"cannot write plot {path}: {exc}") from None
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def frontier_figure(predictions: list[Prediction], title: str = ""):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    draw_frontier(ax, predictions, title, label="predicted frontier")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def frontier_title(model: str, hardware: HardwareProfile, prompt_len: int, gen_len: int) -> str:
    """A plot's title: the model, the machine with the memory the planner may fill (its cap), the workload."""
    return (f"{model} on {hardware.name} (GPU {format_size(hardware.capacity('gpu'))}, "
            f"CPU {format_size(hardware.capacity('cpu'))})\nprompt {prompt_len}, generate {gen_len}")


def draw_frontier(ax, predictions: list[Prediction], title: str = "", label: str | None = None,
                  explain: bool = True) -> None:
    """The frontier on ``ax``: one marker a policy, about ten of them labelled with their GPU batch
    size x number of GPU batches (``explain`` says so on the axes)."""
    from matplotlib.ticker import NullFormatter, StrMethodFormatter

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
    if explain:
        ax.text(0.01, 0.99, "point labels: GPU batch size x GPU batches", transform=ax.transAxes, fontsize=7,
                va="top", color="0.3")
    ax.set_xscale("log")
    # Few plain ticks, slanted, and no minor labels: log axes otherwise label minor ticks when the
    # range is under a decade or two, and the labels crowd into each other.
    ax.xaxis.set_major_locator(_LogTicks())
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.set_xlabel("block latency (s)")
    ax.set_ylabel("generation throughput (token/s)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)


def _LogTicks():
    """A matplotlib locator of log_ticks over the axis's view, whatever else is drawn on it."""
    from matplotlib.ticker import Locator

    class LogTicks(Locator):
        def __call__(self):
            low, high = sorted(self.axis.get_view_interval())
            return log_ticks(max(low, 1e-12), max(high, 1e-12))

    return LogTicks()


def log_ticks(low: float, high: float, most: int = 6) -> list[float]:
    """At most ``most`` ticks in [low, high]: of the 1-2-5 series, or of a finer one where that
    gives fewer than three, evenly thinned."""
    for series in ((1, 2, 5), (1, 2, 3, 5, 7), tuple(range(1, 10))):
        exponent = math.floor(math.log10(low))
        inside = []
        while exponent <= math.log10(high):
            inside += [m * 10.0 ** exponent for m in series if low <= m * 10.0 ** exponent <= high]
            exponent += 1
        if len(inside) >= 3:
            break
    step = math.ceil(len(inside) / most) if inside else 1
    return inside[::step] or [low, high]


def format_pipeline_plan(plan, title: str) -> str:
    """A pipeline's plan: each device's layers, memory, policy and prediction, then the job's."""
    lines = [title]
    for stage in plan.stages:
        hardware, prediction = stage.hardware, stage.prediction
        lines.append(f"stage {stage.index}  layers {stage.layers.start}-{stage.layers.stop - 1} · gpu "
                     f"{format_size(hardware.capacity('gpu'))}, cpu {format_size(hardware.capacity('cpu'))} usable · "
                     f"{policy_summary(stage.policy)} · {prediction.total_throughput:.4g} token/s "
                     f"(decode bound by {prediction.decode.bound})")
    replicas = f" × {plan.replicas} replicas" if plan.replicas > 1 else ""
    lines.append(f"job      {plan.throughput:.4g} token/s predicted: stage {plan.slowest.index}, the slowest, sets the "
                 f"pipeline's pace{replicas}")
    return "\n".join(lines)


def describe_hardware(hardware: HardwareProfile) -> str:
    caps = ", ".join(f"{t} {format_size(hardware.capacity(t))}" for t in TIERS)
    return f"{hardware.name} ({caps} usable)"


def _split(fractions) -> str:
    return "/".join(f"{100 * value:.1f}" for value in fractions)


def _experts(llm) -> str:
    """How a mixture's routed experts run, for the policy line; nothing for a dense model."""
    if not getattr(llm.config, "num_experts", 0):
        return ""
    from ..models.moe import expert_kernels
    return f" · experts by {expert_kernels(llm.device, llm.dtype)}"


def _lossy(policy: Policy, stored: CompressionConfig | None = None) -> str:
    """' · weights 4-bit (lossy)' and the like for each compressed part: compression changes the
    outputs, so a run says so; nothing when lossless. Weights read in ``stored``, the format the
    checkpoint stores them in, are the model's own: ' · weights 4-bit g32 as stored'."""
    return "".join(f" · {what} {config.bits}-bit g{config.group_size} as stored" if what == "weights" and config == stored
                   else f" · {what} {config.bits}-bit (lossy)"
                   for what, config in (("weights", policy.compress_weight), ("cache", policy.compress_cache))
                   if config is not None)


def _parallel_lines(llm, ranks_memory: list[dict] | None) -> list[str]:
    """A parallel job's shape, then each process's layers, weights and peaks (``LLM.ranks_memory``);
    without those, the lines after it speak of rank 0's process."""
    from ..layout import tier_name

    ranks = llm.ranks
    if ranks is None:
        return []
    stages, replicas = ranks.parallel.pipeline, ranks.parallel.data
    shape = f"parallel   {stages} pipeline stage{'s' * (stages > 1)} × {replicas} replica{'s' * (replicas > 1)}"
    if ranks_memory is None:
        layers = range_layers(ranks.place.owned, llm.config.num_layers)
        return [f"{shape} · weights and peak memory below are rank 0's (the embedding and layers "
                f"{layers[0]}–{layers[-1]})"]
    lines = [f"{shape} · weights and peak memory below are rank 0's; every rank's:"]
    for rank, report in enumerate(ranks_memory):
        layers = range_layers(range(*report["stages"]), llm.config.num_layers)
        peaks = report["peaks"]
        gpu = f"gpu {format_size(peaks.get('gpu', 0))}, " if llm.device.type == "cuda" else ""
        lines.append(f"  rank {rank:<3} layers {layers[0]}–{layers[-1]} · weights "
                     + " · ".join(f"{tier_name(t, llm.device)} {format_size(report['weights'][t])}" for t in TIERS)
                     + f" · peak {gpu}ram {format_size(peaks.get('cpu_rss', 0))}")
    return lines


def format_summary(llm, metrics, ranks_memory: list[dict] | None = None) -> str:
    """A run's summary: the model and policy, where the weights are, throughput, tokens and peak
    memory; in a parallel job, each process's share (``ranks_memory``, from ``LLM.ranks_memory``)."""
    from ..layout import tier_name

    policy = llm.policy
    placement = llm.engine.placement_report
    peaks = dict(metrics.peak_memory)
    peaks.pop("cpu_weights", None)  # the weights line says where every weight is
    peaks.pop("gpu_store_stream_peak", None)  # a share of the GPU peak, for the calibration
    ram = f"ram {format_size(peaks.pop('cpu_rss', 0))} (process rss"
    ram += f": the {tier_name('gpu', llm.device)} and cpu tiers)" if llm.device.type != "cuda" else ": the cpu tier)"
    memory = [f"{tier_name('gpu', llm.device)} {format_size(peaks.pop('gpu'))}"] if "gpu" in peaks else []
    memory += [ram] + [f"{key} {format_size(value)}" for key, value in peaks.items()]
    lines = [
        f"model      {llm.config.name} · {str(llm.dtype).removeprefix('torch.')} on {llm.device} · "
        f"{metrics.num_sequences} prompts · gpu batch {policy.gpu_batch_size} × {policy.num_gpu_batches}",
        f"policy     % on {'/'.join(tier_name(t, llm.device) for t in TIERS)}: weights requested "
        f"{_split(placement['requested'].values())}, realised {_split(placement['realised'].values())} · "
        f"cache {_split(policy.cache.as_tuple())} · activations {_split(policy.activations.as_tuple())} · "
        f"cpu attention {'on' if policy.cpu_attention else 'off'} · overlap {'on' if policy.overlap else 'off'} · "
        f"cuda graphs {llm.engine.graphs.describe()}" + _experts(llm) + _lossy(policy, llm.config.stored_compression),
        *_parallel_lines(llm, ranks_memory),
        "weights    " + " · ".join(f"{tier_name(t, llm.device)} {format_size(placement['bytes'][t])}" for t in TIERS),
        f"prefill    {metrics.prefill_throughput:12.1f} token/s  ({metrics.prefill_time:.3f} s)",
        f"decode     {metrics.decode_throughput:12.1f} token/s  ({metrics.decode_time:.3f} s)",
        f"total      {metrics.total_throughput:12.1f} token/s  ({metrics.total_time:.3f} s)",
        f"tokens     prompt {metrics.prompt_tokens} actual / {metrics.padded_prompt_tokens} padded · "
        + (f"{metrics.shared_prompt_tokens} shared · " if metrics.shared_prompt_tokens > 0 else "")
        + f"generated {metrics.generated_tokens} actual / {metrics.padded_generated_tokens} padded · "
        f"efficiency {100 * metrics.efficiency:.1f}%",
        "peak mem   " + " · ".join(memory),
    ]
    return "\n".join(lines)


def format_table(summary: dict) -> str:
    """A bench summary (see flexoff.harness.bench.summarize) as the terminal shows it."""
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    k = summary["in_context_examples"]
    lines = [f"scenario   {summary['scenario']} · {summary['instances']} instances · model {summary['model']} · "
             f"in-context examples {k['min']}" + (f"–{k['max']}" if k["max"] != k["min"] else ""),
             f"{'metric':<24}{'mean':>12}"]
    lines += [f"{name:<24}{fmt(value):>12}" for name, value in summary["metrics"].items()]
    lines.append(f"{'ref_logprob':<24}{fmt(summary['ref_logprob']):>12}   (sum over the reference's tokens)")
    if summary["truncated_prompts"]:
        lines.append(f"truncated prompts       {summary['truncated_prompts']:>12}")
    gen = summary["generation"]
    if gen is None:
        lines.append("throughput: nothing was generated in this run (every result was already written)")
    else:
        lines.append(f"throughput  actual {gen['actual_throughput']:.1f} token/s · padded "
                     f"{gen['padded_throughput']:.1f} token/s · efficiency {100 * gen['efficiency']:.1f}% · "
                     f"generated {gen['total_throughput']:.1f} token/s")
    lines.append(f"wall time   {summary['wall_seconds']:.1f} s")
    return "\n".join(lines)


class ProgressLine:
    """A long step's progress on stderr, as a profiler's ``progress(fraction, step)`` reports it (step
    None: done): one line rewritten in place on a terminal, else a line per report (a log keeps each)."""

    def __init__(self, prefix: str, stream=None):
        self.prefix, self.stream = prefix, stream or sys.stderr
        self.live = self.stream.isatty()

    def __call__(self, fraction: float, step: str | None) -> None:
        text = f"{self.prefix} {fraction:4.0%}" + (f"  {step}" if step else "")
        if self.live:  # \r and erase to the end of the line: the new text replaces the old
            text = "\r\x1b[K" + text + ("\n" if step is None else "")
        else:
            text += "\n"
        self.stream.write(text)
        self.stream.flush()
