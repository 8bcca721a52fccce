"""Tables of predicted against measured, in markdown ready for bench/RESULTS.md, and their summary.

A record (one run, as --json keeps it) holds "predicted" and "measured" dicts with the same keys:
total/prefill/decode_throughput in token/s, and gpu/cpu/disk peak bytes ("measured" holds "error"
instead when the run failed, and is empty with --predict-only).
"""

from __future__ import annotations

GiB = 1 << 30
THROUGHPUT_TARGET, MEMORY_TARGET = 0.15, 0.10
GRID_TARGET = 0.10  # the searched policy within this of the grid's best measured throughput
# A CPU prediction this small (the model all on the card) has no meaningful relative error.
CPU_COUNTED_FROM = 1 * GiB
THROUGHPUTS = ("total_throughput", "prefill_throughput", "decode_throughput")


def error(measured, predicted) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted - 1


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:+.0f}%"


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _gib(value) -> str:
    return "-" if value is None else f"{value / GiB:.1f}"


def _run_seconds(measured: dict) -> str:
    """The child's whole time, and the model's build within it (what to budget a call by)."""
    if "seconds" not in measured:
        return "-"
    build = measured.get("build_seconds")
    return f"{measured['seconds']:.0f}" + ("" if build is None else f" (build {build:.0f})")


def _caps(record) -> str:
    caps = [f"{tier} {record[key]}" for tier, key in (("gpu", "gpu_mem"), ("cpu", "cpu_mem")) if record.get(key)]
    return ", ".join(caps) or "full"


CASE_HEADER = ("| case | caps | policy | token/s pred | meas | err | prefill pred | meas | err "
               "| decode pred | meas | err | GPU GiB pred | meas | err | allocated | CPU GiB pred | meas | err "
               "| disk GiB pred | meas | block s pred | run s |")


def gpu_held(measured: dict):
    """The GPU peak a prediction is judged by: what the allocator reserved (blocks a side stream
    still reads count, as do its segments), which is what the card must hold and what a cap
    limits; runs recorded before it was measured give the allocated peak."""
    return measured.get("gpu_reserved") or measured.get("gpu")


def case_row(record: dict) -> str:
    pred, meas = record["predicted"], record["measured"]
    head = f"| {record['name']} | {_caps(record)} | {record['summary']} | "
    if "error" in meas:
        return head + f"{_number(pred['total_throughput'])} | failed: {meas['error'][:80]} |" + " |" * 18
    cells = []
    for key in THROUGHPUTS:
        cells += [_number(pred[key]), _number(meas.get(key)), _percent(error(meas.get(key), pred[key]))]
    gpu = gpu_held(meas)
    cells += [_gib(pred["gpu"]), _gib(gpu), _percent(error(gpu, pred["gpu"])), _gib(meas.get("gpu"))]
    cells += [_gib(pred["cpu"]), _gib(meas.get("cpu")), _percent(error(meas.get("cpu"), pred["cpu"]))]
    cells += [_gib(pred["disk"]), _gib(meas.get("disk")), _number(pred["block_latency"]), _run_seconds(meas)]
    return head + " | ".join(cells) + " |"


def separator(header: str) -> str:
    return "| --- " * (header.count("|") - 1) + "|"


def _worst(errors: list[float]) -> str:
    return _percent(max(errors, key=abs)) if errors else "-"


def summary(records: list[dict]) -> str:
    """How many measured runs are within the targets, and the worst error of each kind."""
    ran = [r for r in records if r["measured"] and "error" not in r["measured"]]
    failed = sum(1 for r in records if "error" in r["measured"])
    throughput = [error(r["measured"]["total_throughput"], r["predicted"]["total_throughput"]) for r in ran]
    gpu = [e for e in (error(gpu_held(r["measured"]), r["predicted"]["gpu"]) for r in ran) if e is not None]
    cpu = [error(r["measured"].get("cpu"), r["predicted"]["cpu"]) for r in ran
           if r["predicted"]["cpu"] >= CPU_COUNTED_FROM and r["measured"].get("cpu") is not None]

    def within(errors, target):
        return f"{sum(abs(e) <= target + 1e-12 for e in errors)}/{len(errors)}"

    return (f"throughput within ±{THROUGHPUT_TARGET:.0%}: {within(throughput, THROUGHPUT_TARGET)} "
            f"(worst {_worst(throughput)}); GPU memory within ±{MEMORY_TARGET:.0%}: {within(gpu, MEMORY_TARGET)} "
            f"(worst {_worst(gpu)}); CPU memory within ±{MEMORY_TARGET:.0%}: {within(cpu, MEMORY_TARGET)} "
            f"(worst {_worst(cpu)}; CPU predictions under {CPU_COUNTED_FROM / GiB:.0f} GiB not counted)"
            + (f"; {failed} failed" if failed else ""))


def summaries(records: list[dict]) -> list[str]:
    """The summary lines of a call: every run, the searched ones, and where some were held out of the
    calibration, the runs it was tuned on apart from those it was not (the figure a user meets)."""
    lines = [f"all: {summary(records)}", f"searched: {summary([r for r in records if r['searched']])}"]
    held = [r for r in records if r.get("held_out")]
    if held:
        lines += [f"calibration: {summary([r for r in records if not r.get('held_out')])}",
                  f"held out: {summary(held)}"]
    return lines


GRID_HEADER = ("| policy | step | token/s pred | meas | err | vs searched | pred at search workload "
               "| GPU GiB pred | meas | CPU GiB pred | meas | block s pred | run s |")


def grid_rows(records: list[dict]) -> tuple[list[str], str]:
    """The grid's rows and its verdict. Each run is compared with the searched policy measured in the
    same call ("part"), so that grids split over several calls (and machines) compare fairly."""
    anchors = {r["part"]: r["measured"]["total_throughput"] for r in records
               if r["label"] == "searched" and r["measured"].get("total_throughput")}
    rows, ratios = [], []
    for r in records:
        pred, meas = r["predicted"], r["measured"]
        anchor = anchors.get(r["part"])
        ratio = None
        if meas.get("total_throughput") is not None and anchor:
            ratio = meas["total_throughput"] / anchor
            ratios.append((ratio, r))
        measured = f"failed: {meas['error'][:60]}" if "error" in meas else _number(meas.get("total_throughput"))
        rows.append(f"| {r['summary']} | {r['label']} | {_number(pred['total_throughput'])} | {measured} | "
                    f"{_percent(error(meas.get('total_throughput'), pred['total_throughput']))} | "
                    f"{'-' if ratio is None else f'{ratio:.3f}'} | {_number(r['predicted_search_workload'])} | "
                    f"{_gib(pred['gpu'])} | {_gib(gpu_held(meas))} | {_gib(pred['cpu'])} | {_gib(meas.get('cpu'))} | "
                    f"{_number(pred['block_latency'])} | {_run_seconds(meas)} |")
    return rows, _predicted_verdict(records) + "\n" + _measured_verdict(anchors, ratios)


def _predicted_verdict(records: list[dict]) -> str:
    searched = [r["predicted"]["total_throughput"] for r in records if r["label"] == "searched"]
    best = max(records, key=lambda r: r["predicted"]["total_throughput"])
    share = searched[0] / best["predicted"]["total_throughput"] if searched else None
    return ("predicted: " + ("-" if share is None else f"searched policy at {share:.1%}")
            + f" of the grid's best ({best['label']})")


def _measured_verdict(anchors: dict, ratios: list) -> str:
    if not anchors:
        return "measured: the searched policy was not measured, no verdict"
    best, best_record = max(ratios, key=lambda item: item[0])
    within = 1 / best >= 1 - GRID_TARGET
    neighbours = sum(1 for _, r in ratios if r["label"] != "searched")
    return (f"measured: searched policy at {1 / best:.1%} of the grid's best "
            f"({best_record['label']}: {best_record['summary']}), over {neighbours} measured neighbours: "
            f"{'within' if within else 'NOT within'} {GRID_TARGET:.0%}")


def preamble(card: str | None, date: str, commit: str, command: str, profile: str) -> list[str]:
    return [f"card: {card or 'none (predictions only)'}; date: {date}; commit: {commit}", "",
            "```", command, "```", "", f"profile: {profile}",
            "Errors are (measured - predicted) / predicted. CPU memory is the run's peak resident set above "
            "its resident set before the model was built.", ""]
