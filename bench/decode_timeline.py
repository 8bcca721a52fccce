"""Where a decode step's time goes: a timeline per layer and GPU batch from CUDA events.

Every step the engine takes (schedule.py) is bracketed by a CUDA event on the stream it enqueues
to (loads on the load stream, the rest on the compute stream) and by the host clock. From those,
for each decode token: how long the copy engine was busy, the bytes it moved against the bound
(bytes / measured pinned bandwidth), its idle gaps and what the host was doing then, how busy the
compute stream was, and where the host spent its time.

    python bench/decode_timeline.py --model opt-30b --policy auto --compress auto --hardware h100 \
        --gpu-mem 16GiB --gen-len 4
    python bench/decode_timeline.py --model opt-30b --policy-file policy.json --num-prompts 480
    python bench/decode_timeline.py --model opt-66b --policy-file policy.json --gpu-mem 16GiB \
        --offload-dir /tmp/off --gen-len 2 --decode-kernels 16

``--decode-kernels N`` adds a profile of N decoder layers of a decode step alone: the GPU kernels
that fill them, per layer and GPU batch and per token (bench/decode_kernels.py); ``--kernels``
profiles a 2-token run, whose prefill dominates its table.

The events cost a few microseconds a step (a few percent of a decode step); the step times are
those of the instrumented run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_policy import add_policy_args, cuda_job  # noqa: E402
from bench.decode_kernels import profile_decode  # noqa: E402
from flexoff import LLM, SamplingParams  # noqa: E402
from flexoff.planner.cost_model import CostModel, PhaseBreakdown, Workload  # noqa: E402
from flexoff.planner.report import policy_summary  # noqa: E402
from flexoff.runtime.schedule import LOAD_ACTIVATION, LOAD_CACHE, LOAD_WEIGHTS, SYNC  # noqa: E402

LOADS = (LOAD_WEIGHTS, LOAD_CACHE, LOAD_ACTIVATION)


def pinned_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Bytes/s of a pinned host-to-GPU copy (the best of three)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


class Timeline:
    """The engine's observer: brackets every step with events on its stream and the host clock.

    A step's end is marked when the next step is observed (the observer runs before each step).
    """

    def __init__(self, engine):
        self.engine = engine
        self.streams = engine.streams
        self.entries: list[dict] = []
        self.batches = None
        self._open = None
        self._ref = None
        self._ref_host = 0.0
        make = engine.make_batches

        def capture(*args, **kwargs):  # the bench needs the batches to count cache bytes
            self.batches = make(*args, **kwargs)
            return self.batches

        engine.make_batches = capture

    def _event(self, stream):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def __call__(self, step) -> None:
        now = time.perf_counter()
        if self._ref is None:
            torch.cuda.synchronize()
            self._ref = self._event(self.streams.compute)
            torch.cuda.synchronize()
            self._ref_host = now = time.perf_counter()
        if self._open is not None:
            entry = self._open
            entry["host_end"] = now
            entry["gpu_end"] = self._event(entry["stream"])
            self.entries.append(entry)
            self._open = None
        if step.kind == SYNC:
            return
        stream = {LOAD_CACHE: self.streams.cache}.get(step.kind, self.streams.load) if step.kind in LOADS \
            else self.streams.compute
        self._open = {"step": step, "stream": stream, "host_start": now, "gpu_start": self._event(stream),
                      "bytes": self._bytes(step)}

    def _bytes(self, step) -> int:
        """Bytes a load step moves host-to-GPU (stored size)."""
        if step.kind == LOAD_WEIGHTS:
            pieces = self.engine.weights._stages[self.engine.stages[step.stage]]
            total = 0
            for parts in pieces.parts.values():
                for _, _, storage in parts:
                    for part in (storage.data, storage.scale, storage.minimum) if hasattr(storage, "scale") \
                            else (storage,):
                        if isinstance(part, torch.Tensor) and part.device.type == "cpu":
                            total += part.numel() * part.element_size()
            return total
        if step.kind == LOAD_CACHE and self.batches is not None:
            batch = self.batches[step.batch]
            start = batch.slot_start(step.token)
            total = 0
            for group in batch.kv.groups:
                if group.tier == "gpu":
                    continue
                keys = group.pair(step.stage - 1)[0]
                slots = keys.shape[group.layout.slot_dim]
                total += 2 * group.fmt.size_of(keys) * start // slots
            return total
        return 0

    def reset(self) -> None:
        # The last block's batches go too: they hold its host cache.
        self.entries, self._open, self._ref, self.batches = [], None, None, None

    def resolved(self) -> list[dict]:
        """Entries with host and GPU times in ms from the reference point."""
        torch.cuda.synchronize()
        rows = []
        for entry in self.entries:
            step = entry["step"]
            rows.append({
                "kind": step.kind, "token": step.token, "stage": step.stage, "batch": step.batch,
                # both load streams draw on the same link: the copy engine's use is their union
                "stream": "compute" if entry["stream"] is self.streams.compute else "load",
                "host_start": (entry["host_start"] - self._ref_host) * 1e3,
                "host_end": (entry["host_end"] - self._ref_host) * 1e3,
                "gpu_start": self._ref.elapsed_time(entry["gpu_start"]),
                "gpu_end": self._ref.elapsed_time(entry["gpu_end"]),
                "bytes": entry["bytes"],
            })
        return rows


def busy_union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def analyse(rows: list[dict], bandwidth: float) -> list[dict]:
    """Per decode token: span, copy-engine use against the bound, idle causes, host time by step kind."""
    by_token = defaultdict(list)
    for row in rows:
        by_token[row["token"]].append(row)
    summaries = []
    for token in sorted(by_token):
        if token == 0:
            continue  # the prefill
        steps = by_token[token]
        loads = sorted((r for r in steps if r["stream"] == "load"), key=lambda r: r["gpu_start"])
        computes = [r for r in steps if r["stream"] == "compute"]
        begin = min(min(r["gpu_start"] for r in steps), min(r["host_start"] for r in steps))
        end = max(max(r["gpu_end"] for r in steps), max(r["host_end"] for r in steps))
        span = end - begin
        moved = sum(r["bytes"] for r in loads)
        load_busy = busy_union([(r["gpu_start"], r["gpu_end"]) for r in loads])
        compute_busy = busy_union([(r["gpu_start"], r["gpu_end"]) for r in computes])
        # A gap in the load stream is the host's fault when the next load was enqueued only after
        # the previous one had finished; otherwise the stream waited on an event (or nothing was due).
        host_late = waiting = 0.0
        for before, after in zip(loads, loads[1:]):
            gap = after["gpu_start"] - before["gpu_end"]
            if gap <= 0:
                continue
            if after["host_end"] > before["gpu_end"]:
                host_late += min(gap, after["host_end"] - before["gpu_end"])
                waiting += max(0.0, gap - (after["host_end"] - before["gpu_end"]))
            else:
                waiting += gap
        host_by_kind = defaultdict(float)
        for r in steps:
            host_by_kind[r["kind"]] += r["host_end"] - r["host_start"]
        bound = moved / bandwidth * 1e3
        summaries.append({
            "token": token, "span_ms": span, "bytes_gb": moved / 1e9, "bound_ms": bound,
            "fraction_of_bound": bound / span if span else 0.0,
            "load_busy_ms": load_busy, "load_gbps_when_busy": moved / load_busy / 1e6 if load_busy else 0.0,
            "compute_busy_ms": compute_busy, "load_idle_host_late_ms": host_late,
            "load_idle_waiting_ms": waiting, "host_ms_by_kind": dict(host_by_kind),
            "host_busy_ms": sum(host_by_kind.values()),
        })
    return summaries


def print_layers(rows: list[dict], token: int, layers: int) -> None:
    """The first ``layers`` decoder layers of one token, step by step (ms from the token's start)."""
    steps = [r for r in rows if r["token"] == token and 1 <= r["stage"] <= layers]
    if not steps:
        return
    zero = min(r["host_start"] for r in steps)
    print(f"\ntoken {token}, layers 1..{layers}: host enqueue start/end, GPU start/end (ms), MB")
    for r in steps:
        print(f"  {r['kind']:<17} L{r['stage']:<3} b{r['batch']:<3} host {r['host_start'] - zero:8.2f} "
              f"{r['host_end'] - zero:8.2f}  gpu {r['gpu_start'] - zero:8.2f} {r['gpu_end'] - zero:8.2f}  "
              f"{r['bytes'] / 1e6:8.1f}")


def show(rows: list[dict], m, bandwidth: float, layers: int) -> list[dict]:
    print(f"measured prefill {m.prefill_throughput:.0f} token/s, decode {m.decode_throughput:.1f} token/s, "
          f"total {m.total_throughput:.1f} (instrumented)")
    summaries = analyse(rows, bandwidth)
    print("token  span ms  GB moved  bound ms  of bound  load busy ms  GB/s busy  compute busy ms  "
          "idle: host late / waiting ms  host busy ms")
    for s in summaries:
        print(f"{s['token']:5d} {s['span_ms']:8.1f} {s['bytes_gb']:9.2f} {s['bound_ms']:9.1f} "
              f"{s['fraction_of_bound']:8.0%} {s['load_busy_ms']:13.1f} {s['load_gbps_when_busy']:10.1f} "
              f"{s['compute_busy_ms']:16.1f} {s['load_idle_host_late_ms']:15.1f} / "
              f"{s['load_idle_waiting_ms']:.1f} {s['host_busy_ms']:14.1f}")
    if summaries:
        print("host ms by step kind, last token:",
              ", ".join(f"{k} {v:.1f}" for k, v in sorted(summaries[-1]["host_ms_by_kind"].items())))
        print_layers(rows, summaries[-1]["token"], layers)
    return summaries


def print_syncs(run) -> None:
    """Run ``run()`` in torch's sync debug mode and print each place in flexoff where the calling
    thread synchronised with the GPU, with its count: each one stalls the host's enqueuing."""
    import threading
    import traceback
    import warnings

    counts: dict[str, int] = defaultdict(int)
    main_thread = threading.get_ident()

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message) or threading.get_ident() != main_thread:
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/flexoff/" in f.filename]
        counts[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))] += 1

    shown = warnings.showwarning
    warnings.showwarning = note
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    print(f"\nmain-thread synchronisations in a 2-token run: {sum(counts.values())}")
    for where, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"{count:8d}  {where}")


def show_prefill_terms(prefill: PhaseBreakdown, batches: int) -> None:
    """The cost model's prefill terms in the kernel table's units, µs per layer and GPU batch: the
    compute terms add up (what the compute stream's kernels should sum to), the streams overlap them."""
    print(f"\ncost model, prefill, us per layer and GPU batch (phase: {prefill.seconds_per_layer / batches * 1e6:.0f}, "
          f"bound by {prefill.bound})")
    for group, terms in (("compute", prefill.compute), ("stream", prefill.io)):
        for name, seconds in terms.items():
            if seconds:
                print(f"  {group:<8} {name:<20} {seconds / batches * 1e6:10.1f}")
    print(f"  compute  {'sum':<20} {sum(prefill.compute.values()) / batches * 1e6:10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_policy_args(parser)
    parser.add_argument("--gen-len", type=int, default=4)
    parser.add_argument("--kernels", action="store_true",
                        help="also profile a 2-token run with torch.profiler and print the top GPU kernels")
    parser.add_argument("--decode-kernels", type=int, default=0, metavar="N",
                        help="also profile N decoder layers (all GPU batches) of a decode step alone, or the "
                             "whole step where N covers every layer, and print the kernels that fill them")
    parser.add_argument("--prefill-kernels", type=int, default=0, metavar="N",
                        help="the same for N decoder layers of the prefill (its kernels against the cost "
                             "model's prefill terms)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the last token to print step by step")
    parser.add_argument("--cprofile", type=int, nargs="?", const=2, default=0, metavar="TOKENS",
                        help="also run a generation of TOKENS tokens (default 2) under cProfile (the main "
                             "thread's Python time); more tokens weigh decode against the prefill")
    parser.add_argument("--sync-debug", action="store_true",
                        help="also run a 2-token generation in torch's sync debug mode and print where the "
                             "main thread synchronised with the GPU")
    parser.add_argument("--jobs-in-flight", default="",
                        help="comma-separated values of the host worker's job limit to time in turn (default: as built)")
    parser.add_argument("--json", help="write every step and the summaries here")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="decode layers enqueued kernel by kernel")
    args = parser.parse_args()
    config, hardware, policy, num_prompts = cuda_job(args, "decode_timeline needs CUDA (the timeline is of the GPU's "
                                                           "streams)")
    workload = Workload(args.prompt_len, args.gen_len, num_prompts)
    predicted = CostModel(config, workload, hardware).predict(policy)
    print(f"policy: {policy_summary(policy)}")
    print(f"predicted decode {predicted.decode_throughput:.1f} token/s, total {predicted.total_throughput:.1f}")
    llm = LLM(args.model, dummy=True, policy=policy, offload_dir=args.offload_dir, gpu_mem=args.gpu_mem,
              cpu_mem=args.cpu_mem, cuda_graphs=not args.no_cuda_graphs)
    bandwidth = pinned_bandwidth()
    print(f"pinned host-to-GPU copy: {bandwidth / 1e9:.1f} GB/s; {torch.cuda.get_device_name()}")
    # Distinct from their first token, so no two rows share a prefix (7 and the 5000 are coprime).
    prompts = [[100 + (7 * i + 13 * j) % 5000 for j in range(args.prompt_len)] for i in range(num_prompts)]
    llm.generate([p[:16] for p in prompts], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
    print(f"cuda graphs after the warm-up: {llm.engine.graphs.describe()}")
    timeline = Timeline(llm.engine)
    llm.engine.observer = timeline
    report = {"policy": policy.to_dict(), "bandwidth": bandwidth, "runs": []}
    for limit in [int(v) for v in args.jobs_in_flight.split(",") if v] or [None]:
        if limit is not None:
            llm.engine.worker.MAX_IN_FLIGHT = limit
        print(f"\n== host jobs in flight: {llm.engine.worker.MAX_IN_FLIGHT}")
        timeline.reset()
        result = llm.generate(prompts, SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True))
        rows = timeline.resolved()
        report["runs"].append({"jobs_in_flight": llm.engine.worker.MAX_IN_FLIGHT, "steps": rows,
                               "summaries": show(rows, result.metrics, bandwidth, args.layers)})
    timeline.reset()
    if args.kernels:
        llm.engine.observer = None
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            llm.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if args.decode_kernels or args.prefill_kernels:
        del llm.engine.make_batches  # the timeline's capture would keep the run's host cache alive
    if args.decode_kernels:
        report["decode_kernels"] = profile_decode(llm, prompts, args.decode_kernels)
    if args.prefill_kernels:
        report["prefill_kernels"] = profile_decode(llm, prompts, args.prefill_kernels, token=0)
        show_prefill_terms(predicted.prefill, policy.num_gpu_batches)
    if args.sync_debug:
        llm.engine.observer = None
        few = prompts[:2 * policy.gpu_batch_size]  # two GPU batches make every kind of step
        print_syncs(lambda: llm.generate(few, SamplingParams(max_new_tokens=2, ignore_eos=True)))
    if args.cprofile:
        import cProfile
        import pstats

        llm.engine.observer = None
        profiler = cProfile.Profile()
        profiler.enable()
        llm.generate(prompts, SamplingParams(max_new_tokens=args.cprofile, ignore_eos=True))
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(45)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(70)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    llm.close()


if __name__ == "__main__":
    main()
