"""Which GPU kernels fill a decode step: torch.profiler over decode steps, and nothing else (or
over the prefill's layers alone, ``token=0``).

A profile of a whole generation is dominated by its prefill (hundreds of prompt tokens per row
against one per decode step), so its kernel table says nothing of decode. Here the engine's
observer (which sees every step of the block schedule before it runs) records a window of the
first decode step: N decoder layers from the middle of the model, every GPU batch of each (or the
whole step, embedding and head included, where N covers every layer). Layers are alike, so a few
of them stand for the step, and the trace (CPU ops included) stays small. Each step runs inside a
``record_function`` range, and so do a few flexoff functions (wrapped for the window only), so
each kernel is traced back through its launch (the CUDA API call on the host, which shares the
kernel's correlation id) to the innermost range around it: the code that launched it.

One marker kernel (``torch.cuda._sleep``) is launched on each of the engine's streams at the start,
one at a time, to learn which trace stream is the compute stream. The start synchronises the device
once (the first layer's loads are then done before its compute); the profiler slows the host's
enqueuing, so idle time on the compute stream is an upper bound, while each kernel's duration is
its own. Figures per token are per layer and GPU batch times layers times batches.

    python bench/decode_timeline.py --model opt-66b --policy-file P.json --gpu-mem 16GiB \
        --offload-dir /tmp/off --gen-len 2 --decode-kernels 16
"""

from __future__ import annotations

import gc
import json
import os
import re
import tempfile
import time
from collections import Counter, defaultdict

import torch

from flexoff import SamplingParams
from flexoff.models import architecture
from flexoff.runtime import kv, kv_storage, weight_store
from flexoff.runtime.schedule import COMPUTE, SYNC

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel
STEP = re.compile(r"^step:(\w+):(\w+) t(-?\d+) s(-?\d+) b(-?\d+)$")
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}


def pass_name(token: int) -> str:
    return "the prefill" if token == 0 else f"decode step {token}"


def progress(what: str) -> None:
    """A timestamped line with the host's available memory and this process's resident set."""
    fields = {}
    for path, key in (("/proc/meminfo", "MemAvailable"), ("/proc/self/status", "VmRSS")):
        try:
            with open(path) as f:
                fields[key] = next(int(line.split()[1]) for line in f if line.startswith(key)) / 2**20
        except (OSError, StopIteration):
            pass
    memory = ", ".join(f"{k} {v:.1f} GiB" for k, v in fields.items())
    print(f"[decode kernels {time.strftime('%H:%M:%S')}] {what} ({memory})", flush=True)


def _wrapped(owner, attr: str, label: str):
    """(owner, attr, original) after replacing ``owner.attr`` with a call inside ``record_function``."""
    original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    static = isinstance(original, staticmethod)
    function = original.__func__ if static else original

    def call(*args, **kwargs):
        with torch.profiler.record_function(f"fn:{label}"):
            return function(*args, **kwargs)

    setattr(owner, attr, staticmethod(call) if static else call)
    return owner, attr, original


def _code_ranges(arch) -> list[tuple]:
    """Ranges around the code a decode layer runs (the architecture's halves of a layer, and the
    cache's and weight store's steps). Undone by ``DecodeKernelProfile.stop``."""
    targets = [(weight_store.StageWeights, "__getitem__", "weights: read (dequantize)"),
               (kv.BatchKV, "_attend_loaded", "cache: attend on the loaded rows"),
               (kv.BatchKV, "_send_slot", "cache: new slot home"),
               (kv.BatchKV, "_store", "cache: store new slot"),
               (kv_storage.QuantizedFormat, "decode", "cache: dequantize"),
               (kv_storage.QuantizedFormat, "fill", "cache: quantize new slot"),
               (kv, "attention", "attention (sdpa)")]
    targets += [(arch, name, f"layer: {name}") for name in ("attention_inputs", "after_attention")
                if hasattr(arch, name)]
    return [_wrapped(*target) for target in targets]


class DecodeKernelProfile:
    """The engine's observer for one profiled generation: records ``layers`` decoder layers of
    token ``token``'s pass (1: the first decode step; 0: the prefill), all of it where they are every
    layer, each step inside a range named ``step:KIND:STAGE tTOKEN sSTAGE bBATCH``."""

    def __init__(self, engine, layers: int, token: int = 1):
        self.engine = engine
        self.token = token
        self.stage_kinds = [stage.kind for stage in engine.stages]
        total = engine.cfg.num_layers
        # Stages: 0 the embedding, 1..total the decoder layers, then the head.
        self.whole = layers >= total
        self.first = 0 if self.whole else 1 + (total - layers) // 2
        self.stop_at = len(self.stage_kinds) if self.whole else self.first + layers
        streams = engine.streams
        named = [("compute", streams.compute or torch.cuda.current_stream()), ("load", streams.load),
                 ("cache", streams.cache), ("store", streams.store)]
        self.streams: list[tuple[str, torch.cuda.Stream]] = []
        for name, stream in named:  # without overlap they are all one stream
            if stream is not None and all(stream != s for _, s in self.streams):
                self.streams.append((name, stream))
        self.profiler = None
        self.recording = False
        self._range = None
        self._patched: list[tuple] = []
        self.layer_steps: set[tuple[int, int, int]] = set()  # (token, stage, batch) of recorded layers

    def __call__(self, step) -> None:
        self._close_range()
        if self.profiler is None:
            if step.kind == COMPUTE and step.token == self.token and step.stage == self.first:
                self._start()
            else:
                return
        if not self.recording:
            return
        if step.kind == SYNC or (step.kind == COMPUTE and (step.token > self.token or step.stage >= self.stop_at)):
            self.finish()
            return
        kind = self.stage_kinds[step.stage] if 0 <= step.stage < len(self.stage_kinds) else "-"
        if step.kind == COMPUTE and kind == "layer":
            self.layer_steps.add((step.token, step.stage, step.batch))
        self._range = torch.profiler.record_function(
            f"step:{step.kind}:{kind} t{step.token} s{step.stage} b{step.batch}")
        self._range.__enter__()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _start(self) -> None:
        torch.cuda.synchronize()
        progress(f"recording from stage {self.first} of {pass_name(self.token)}")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()
        self.recording = True
        for _, stream in self.streams:  # one at a time: the markers' order in time names the streams
            with torch.cuda.stream(stream):
                torch.cuda._sleep(1000)
            torch.cuda.synchronize()
        self._patched = _code_ranges(architecture(self.engine.cfg))

    def finish(self) -> None:
        """Stop recording (once; the profiler synchronises the device) and undo the wrapping."""
        self._close_range()
        for owner, attr, original in reversed(self._patched):
            setattr(owner, attr, original)
        self._patched = []
        if self.recording:
            self.recording = False
            self.profiler.stop()
            progress(f"recorded {len(self.layer_steps)} layer steps")


def _innermost(ranges: list[tuple[float, float, str]], points: list[tuple[float, int]]) -> dict[int, list[str]]:
    """For each point (time, key): the names of the properly nested ranges around it, outermost first."""
    ranges = sorted(ranges, key=lambda r: (r[0], -r[1]))
    out, stack, i = {}, [], 0
    for t, key in sorted(points):
        while i < len(ranges) and ranges[i][0] <= t:
            while stack and stack[-1][1] < ranges[i][0]:
                stack.pop()
            stack.append(ranges[i])
            i += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        out[key] = [r[2] for r in stack if r[0] <= t <= r[1]]
    return out


def _short(name: str, width: int = 78) -> str:
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "c10::", "at::cuda::"):
        name = name.replace(noise, "")
    return name if len(name) <= width else name[:width - 1] + "~"


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def read_trace(path: str, stream_names: list[str]) -> dict:
    """The device activities of a trace (kernels, copies, memsets), each with its stream's name, its
    step and the innermost range around its launch, and the op that launched it."""
    def keep(d: dict):  # events the summary reads, and nothing else, are kept while parsing
        if "ph" not in d:
            return d  # an event's args, or the trace itself
        cat = str(d.get("cat", "")).lower()
        wanted = d["ph"] == "X" and (cat in DEVICE_CATS or cat in LAUNCH_CATS or cat in ("user_annotation", "cpu_op"))
        return dict(d, cat=cat) if wanted else None

    with open(path) as f:
        data = json.load(f, object_hook=keep)
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e is not None]
    device, launches, ranges, ops = [], {}, defaultdict(list), {}
    for e in events:
        cat, args = e["cat"], e.get("args") or {}
        if cat in DEVICE_CATS:
            device.append(e)
        elif cat in LAUNCH_CATS and "correlation" in args:
            launches[args["correlation"]] = (e["ts"], e.get("tid"))
        elif cat == "user_annotation":
            ranges[e.get("tid")].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        elif cat == "cpu_op" and "External id" in args:
            ops[args["External id"]] = e["name"]
    device.sort(key=lambda e: e["ts"])
    markers = [e for e in device if MARKER in e["name"]]
    stream_of = {}
    for e, name in zip(markers, stream_names):
        stream_of.setdefault((e.get("args") or {}).get("stream", e.get("tid")), name)
    if not stream_of:  # no marker: the stream with the most kernel time computes
        spent = Counter()
        for e in device:
            if e["cat"] == "kernel":
                spent[(e.get("args") or {}).get("stream", e.get("tid"))] += e.get("dur", 0.0)
        stream_of = {spent.most_common(1)[0][0]: "compute"} if spent else {}
    begin = markers[-1]["ts"] + markers[-1].get("dur", 0) if markers else (device[0]["ts"] if device else 0.0)
    points = defaultdict(list)  # thread -> (launch time, index of the activity)
    for index, e in enumerate(device):
        launch = launches.get((e.get("args") or {}).get("correlation"))
        if launch is not None:
            points[launch[1]].append((launch[0], index))
    around: dict[int, list[str]] = {}
    for thread, pts in points.items():
        around.update(_innermost(ranges.get(thread, []), pts))
    rows = []
    for index, e in enumerate(device):
        if MARKER in e["name"] or e["ts"] < begin:
            continue
        args = e.get("args") or {}
        stream = args.get("stream", e.get("tid"))
        names = around.get(index) or []
        steps = [STEP.match(n) for n in names if n.startswith("step:")]
        if not steps:
            where = names[-1] if names else "(launched off the main thread)"
        else:
            step = f"{steps[-1].group(1)}:{steps[-1].group(2)}"
            inner = f"{names[-1][3:]}" if names[-1].startswith("fn:") else "(rest)"
            where = inner if step == "compute:layer" and inner != "(rest)" else f"{step} {inner}"
        op = ops.get(args.get("External id"), "-")
        rows.append({"name": e["name"], "cat": str(e.get("cat")).lower(), "stream": stream_of.get(stream, f"stream {stream}"),
                     "start": e["ts"], "end": e["ts"] + e.get("dur", 0.0), "bytes": args.get("bytes", 0),
                     "step": steps[-1].group(0) if steps else None, "where": where,
                     "op": op if not str(op).startswith(("step:", "fn:")) else "-"})
    return {"rows": rows, "markers_found": len(markers), "begin": begin}


def summarise(rows: list[dict], layer_batches: int, layers: int, batches: int, top: int = 25) -> dict:
    """Kernel table, streams and code locations, in µs per layer and GPU batch (over the
    ``layer_batches`` recorded) and ms per decode token (that, times layers times batches)."""
    per_lb = layer_batches
    tokens = layer_batches / (layers * batches)  # decode steps' worth of layers recorded
    compute = [r for r in rows if r["stream"] == "compute"]
    span = (max(r["end"] for r in rows) - min(r["start"] for r in rows)) if rows else 0.0
    compute_busy = _union([(r["start"], r["end"]) for r in compute])
    compute_sum = sum(r["end"] - r["start"] for r in compute) or 1.0
    streams = {}
    for name in sorted({r["stream"] for r in rows}):
        mine = [r for r in rows if r["stream"] == name]
        streams[name] = {"busy_ms_per_token": _union([(r["start"], r["end"]) for r in mine]) / 1e3 / tokens,
                         "activities_per_token": len(mine) / tokens,
                         "gb_copied_per_token": sum(r["bytes"] or 0 for r in mine) / 1e9 / tokens}
    kernels = defaultdict(lambda: {"us": 0.0, "calls": 0, "where": Counter(), "op": Counter(), "stream": Counter()})
    for r in rows:
        k = kernels[r["name"]]
        k["us"] += r["end"] - r["start"]
        k["calls"] += 1
        k["where"][r["where"]] += r["end"] - r["start"]
        k["op"][r["op"]] += 1
        k["stream"][r["stream"]] += 1
    table = []
    for name, k in sorted(kernels.items(), key=lambda kv_: -kv_[1]["us"])[:top]:
        on_compute = k["stream"].get("compute", 0) == k["calls"]
        table.append({"kernel": name, "stream": k["stream"].most_common(1)[0][0], "calls_per_layer_batch": k["calls"] / per_lb,
                      "ms_per_token": k["us"] / 1e3 / tokens, "us_per_layer_batch": k["us"] / per_lb,
                      "share_of_compute": k["us"] / compute_sum if on_compute else None,
                      "where": k["where"].most_common(1)[0][0], "op": k["op"].most_common(1)[0][0]})
    places = defaultdict(lambda: [0.0, 0])
    for r in compute:
        places[r["where"]][0] += r["end"] - r["start"]
        places[r["where"]][1] += 1
    where = [{"where": w, "ms_per_token": us / 1e3 / tokens, "us_per_layer_batch": us / per_lb,
              "launches_per_layer_batch": n / per_lb, "share_of_compute": us / compute_sum}
             for w, (us, n) in sorted(places.items(), key=lambda kv_: -kv_[1][0])]
    # Each decoder layer's compute step on the compute stream: its kernels' busy time against the
    # time from its first kernel's start to its last one's end (the rest: waits inside the step).
    steps = defaultdict(list)
    for r in compute:
        if r["step"] and r["step"].startswith("step:compute:layer"):
            steps[r["step"]].append((r["start"], r["end"]))
    layer_steps = {"first batch": [], "other batches": []}
    for label, spans in steps.items():
        batch = int(STEP.match(label).group(5))
        layer_steps["first batch" if batch == 0 else "other batches"].append(
            (_union(spans) / 1e3, (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3, len(spans)))
    return {"layer_batches": layer_batches, "tokens": tokens, "layers": layers, "batches": batches, "span_ms_per_token": span / 1e3 / tokens,
            "compute_busy_ms_per_token": compute_busy / 1e3 / tokens,
            "compute_kernel_ms_per_token": compute_sum / 1e3 / tokens, "streams": streams, "kernels": table,
            "where": where, "layer_steps": {k: v for k, v in layer_steps.items() if v}}


def show(s: dict, token: int = 1) -> None:
    """Print a summary; "a token" is one pass over the model: ``token``'s (0: the whole prefill)."""
    per_lb = s["layer_batches"]
    print(f"\n== kernels of {pass_name(token)}: {per_lb} layer-batches recorded, {s['tokens']:.3g} of its "
          f"{s['layers']} layers x {s['batches']} GPU batches; ms/token = us/lb x {s['layers'] * s['batches']} / 1000")
    print(f"GPU span {s['span_ms_per_token']:.1f} ms a token")
    print(f"compute stream: busy {s['compute_busy_ms_per_token']:.1f} ms a token "
          f"({s['compute_busy_ms_per_token'] / max(s['span_ms_per_token'], 1e-9):.0%} of the span), "
          f"{s['compute_busy_ms_per_token'] * 1e3 * s['tokens'] / per_lb:.0f} us per layer-batch")
    print("stream      busy ms/token  activities/token  GB copied/token")
    for name, st in s["streams"].items():
        print(f"{name:<10} {st['busy_ms_per_token']:14.1f} {st['activities_per_token']:17.0f} {st['gb_copied_per_token']:16.2f}")
    print(f"\ntop {len(s['kernels'])} kernels by GPU time (us/lb: per layer and GPU batch; share: of the compute "
          "stream's kernel time)")
    print(f"{'ms/token':>9} {'us/lb':>8} {'calls/lb':>8} {'share':>6}  {'stream':<8} {'op':<34} {'launched in':<34} kernel")
    for k in s["kernels"]:
        share = f"{k['share_of_compute']:6.1%}" if k["share_of_compute"] is not None else "     -"
        print(f"{k['ms_per_token']:9.2f} {k['us_per_layer_batch']:8.1f} {k['calls_per_layer_batch']:8.2f} {share}  "
              f"{k['stream']:<8} {_short(k['op'], 34):<34} {_short(k['where'], 34):<34} {_short(k['kernel'])}")
    print("\ncompute stream by the code that launched it (innermost range)")
    print(f"{'ms/token':>9} {'us/lb':>8} {'launches/lb':>11} {'share':>6}  where")
    for w in s["where"]:
        print(f"{w['ms_per_token']:9.2f} {w['us_per_layer_batch']:8.1f} {w['launches_per_layer_batch']:11.1f} "
              f"{w['share_of_compute']:6.1%}  {w['where']}")
    print("\ndecoder-layer compute steps on the compute stream, ms: kernels busy / first kernel to last (mean, min-max)")
    for group, values in s["layer_steps"].items():
        busy, span, n = zip(*values)
        print(f"  {group:<14} {len(values):5d} steps  busy {sum(busy) / len(busy):6.2f} ({min(busy):.2f}-{max(busy):.2f})"
              f"  span {sum(span) / len(span):6.2f} ({min(span):.2f}-{max(span):.2f})  {sum(n) / len(n):.0f} activities")


def profile_decode(llm, prompts, layers: int, token: int = 1) -> dict | None:
    """Generate one decode step after the prefill, with the profiler on ``layers`` decoder layers
    of token ``token``'s pass (1: that decode step; 0: the prefill; see the module's docstring);
    print and return the summary (None where none ran)."""
    engine = llm.engine
    observer = DecodeKernelProfile(engine, layers, token)
    previous, engine.observer = engine.observer, observer
    fd, path = tempfile.mkstemp(suffix=".json", prefix="decode_kernels_")
    os.close(fd)
    try:
        # An earlier run's host cache (tens of GiB pinned) must be gone before this run allocates
        # its own beside it, or OPT-66B at 16 GiB is killed for host memory: whatever a reference
        # cycle in the bench's own wrapping may still hold of it is collected first.
        gc.collect()
        llm.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
        observer.finish()
        if observer.profiler is None or not observer.layer_steps:
            print(f"kernels: no layer of {pass_name(token)} ran")
            return None
        gc.collect()  # the block's host cache, before the trace is written and read
        observer.profiler.export_chrome_trace(path)
        progress(f"trace written: {os.path.getsize(path) / 2**20:.0f} MiB")
        trace = read_trace(path, [name for name, _ in observer.streams])
        progress(f"trace read: {len(trace['rows'])} device activities")
    finally:
        observer.finish()  # after an error: undo the wrapping, end the recording
        engine.observer = previous
        os.unlink(path)
    if trace["markers_found"] != len(observer.streams):
        print(f"decode kernels: {trace['markers_found']} stream markers found of {len(observer.streams)}; "
              "streams are named by their markers' order")
    batches = len({batch for _, _, batch in observer.layer_steps})
    summary = summarise(trace["rows"], len(observer.layer_steps), engine.cfg.num_layers, batches)
    show(summary, token)
    return summary
