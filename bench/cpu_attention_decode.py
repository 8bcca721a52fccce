"""Decode with CPU attention, measured through the runtime against the cost model, layer by layer.

A model's first ``--layers`` decoder layers (its real widths, dummy weights) decode with the cache
on the CPU and CPU attention, at several GPU batch shapes and weight placements. For each, the
runtime's time per decode layer is put next to the cost model's, and the time spent inside CPU
attention (timed around each call, on the worker thread) next to the model's attention term alone.
Weights all on the GPU give CPU attention without streaming; the rest show what streaming adds.

    python bench/cpu_attention_decode.py --model opt-30b --layers 8 \\
        --policies 32x2:100,32x2:0,8x4:100,8x4:50 [--hardware h100] [--json out.json]

A policy is GBSxBATCHES:W, W the percent of weights on the GPU (the rest on the CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexoff.runtime.kv as kv_module  # noqa: E402
from flexoff import LLM, Policy, SamplingParams  # noqa: E402
from flexoff.models import resolve_model_config  # noqa: E402
from flexoff.runtime.interpreter import BlockInterpreter  # noqa: E402
from flexoff.planner.cost_model import CostModel, Placement, PolicyFrame, Workload  # noqa: E402
from flexoff.planner.hardware import resolve_hardware  # noqa: E402
from flexoff.policy import TierFractions  # noqa: E402


class AttentionTimer:
    """Wraps the runtime's CPU attention to add up the seconds spent in it."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self._lock = threading.Lock()
        self._inner = kv_module.cpu_attention

    def __call__(self, *args, **kwargs):
        begin = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - begin
                self.calls += 1

    def __enter__(self):
        kv_module.cpu_attention = self
        return self

    def __exit__(self, *exc):
        kv_module.cpu_attention = self._inner


class EventLog:
    """Timestamps of the schedule's host calls, the worker's jobs, and (on CUDA) the GPU finishing
    each weight load, patched in around the runtime's own methods."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.rows: list[tuple[float, str, str]] = []
        self.loads: list[tuple[str, object]] = []
        self._undo: list = []

    def _mark(self, label: str) -> None:
        self.rows.append((time.perf_counter(), threading.current_thread().name, label))

    def _wrap(self, owner, name, label):
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            text = label(*args)
            if text is None:  # nothing worth a line
                return inner(*args, **kwargs)
            self._mark(f"{text} begin")
            try:
                return inner(*args, **kwargs)
            finally:
                self._mark(f"{text} end")

        setattr(owner, name, wrapped)
        self._undo.append((owner, name, inner))

    def __enter__(self):
        engine = self.llm.engine
        store, worker = engine.weights, engine.worker
        self._wrap(store, "prefetch", lambda stage: f"prefetch {stage}")
        for kind in ("compute", "start_attention", "finish_attention"):
            self._wrap(BlockInterpreter, kind, lambda run, step: f"{step.kind} b{step.batch} stage {step.stage}")
        self._wrap(worker, "_run", lambda fn, ready: "job")
        inner_load = store._load

        def load(stage, buffer):
            inner_load(stage, buffer)
            if torch.cuda.is_available():
                done = torch.cuda.Event(enable_timing=True)
                done.record(store.streams.load)
                self.loads.append((stage, done))

        store._load = load
        self._undo.append((store, "_load", inner_load))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            for stage, done in self.loads:
                self.rows.append((self.start + self.origin.elapsed_time(done) / 1e3, "gpu", f"loaded {stage}"))
        for owner, name, inner in reversed(self._undo):
            if owner.__dict__.get(name) is not None and not isinstance(owner, type):
                delattr(owner, name)
            else:
                setattr(owner, name, inner)

    def write(self, path: Path) -> None:
        lines = [f"{(t - self.start) * 1e3:10.3f} {thread[:14]:14s} {label}" for t, thread, label in sorted(self.rows)]
        path.write_text("\n".join(lines) + "\n")


def parse_policy(text: str) -> Policy:
    shape, _, weights = text.partition(":")
    gbs, batches = (int(x) for x in shape.lower().split("x"))
    on_gpu = float(weights or 0) / 100
    return Policy(gbs, batches, TierFractions(on_gpu, 1 - on_gpu, 0), TierFractions(0, 1, 0),
                  TierFractions(1, 0, 0), cpu_attention=True)


def truncated_model(name: str, layers: int, directory: Path) -> Path:
    """A checkpoint directory (config only) for ``name`` cut to its first ``layers`` layers."""
    cfg = resolve_model_config(name)
    if cfg.family != "opt":
        raise SystemExit("only OPT models are cut here")
    raw = {"model_type": "opt", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
           "num_hidden_layers": layers, "num_attention_heads": cfg.num_heads, "ffn_dim": cfg.intermediate_size,
           "max_position_embeddings": cfg.max_positions, "word_embed_proj_dim": cfg.word_embed_proj_dim,
           "do_layer_norm_before": cfg.do_layer_norm_before, "activation_function": "relu"}
    path = directory / f"{name}-{layers}l"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def model_terms(model: CostModel, policy: Policy) -> dict:
    """The model's decode seconds per layer and the terms behind it."""
    frame, placement = PolicyFrame.of(policy), Placement.of(policy, model.config)
    io, compute = model.phase_terms(frame, placement)["decode"]
    resident = replace(policy, weights=TierFractions(1, 0, 0))
    alone = model.phase_terms(PolicyFrame.of(resident), Placement.of(resident, model.config))["decode"][1]
    return {"decode_layer": model.phase_seconds(io, compute, policy.overlap),
            "cpu_attention_alone": alone["cpu_attention"], "cpu_attention": compute["cpu_attention"],
            "weight_copy": io["cpu_to_gpu"], "gpu_matmul": compute["gpu_matmul"], "host": io["host"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="opt-30b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--policies", default="32x2:100,32x2:0,8x4:100,8x4:50")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=16)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own choice)")
    parser.add_argument("--events", help="a directory for one timeline per policy (3 tokens): host calls, worker "
                                         "jobs and weight-load completions, in ms")
    parser.add_argument("--trace", help="a directory for one chrome trace per policy (3 tokens)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = truncated_model(args.model, args.layers, Path(tmp))
        hardware = resolve_hardware(args.hardware)
        print("policy | decode ms/layer measured | model | err | CPU attention ms/layer measured | "
              "model alone | model | weight copy | GPU matmul | host")
        for text in args.policies.split(","):
            policy = parse_policy(text)
            llm = LLM(str(path), dummy=True, policy=policy)
            cfg = llm.config
            model = CostModel(cfg, Workload(args.prompt_len, args.gen_len, policy.block_size), hardware)
            prompts = [[100 + i] * args.prompt_len for i in range(policy.block_size)]
            llm.generate(prompts[:1], SamplingParams(max_new_tokens=3, ignore_eos=True))
            with AttentionTimer() as timer:
                metrics = llm.generate(prompts, SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True)).metrics
            if args.events:
                with EventLog(llm) as log:
                    llm.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
                Path(args.events).mkdir(parents=True, exist_ok=True)
                log.write(Path(args.events) / f"{args.model}-{text.replace(':', '_')}.txt")
            if args.trace:
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=activities) as prof:
                    llm.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
                Path(args.trace).mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(Path(args.trace) / f"{args.model}-{text.replace(':', '_')}.json"))
            llm.close()
            steps = args.gen_len - 1
            measured = metrics.decode_time / steps / cfg.num_layers
            attention = timer.seconds / steps / cfg.num_layers
            terms = model_terms(model, policy)
            row = {"policy": text, "decode_layer": measured, "cpu_attention": attention,
                   "model": terms, "attention_calls": timer.calls}
            rows.append(row)
            ms = {k: v * 1e3 for k, v in terms.items()}
            print(f"{text} | {measured * 1e3:.2f} | {ms['decode_layer']:.2f} | "
                  f"{terms['decode_layer'] / measured - 1:+.0%} | {attention * 1e3:.2f} | "
                  f"{ms['cpu_attention_alone']:.2f} | {ms['cpu_attention']:.2f} | {ms['weight_copy']:.2f} | "
                  f"{ms['gpu_matmul']:.2f} | {ms['host']:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "layers": args.layers,
                                               "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                                               else "cpu", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
