"""The runtime's host time per layer and GPU batch, by batch shape and by where the cache lives.

`flexoff profile` times the host over a few GPU batches of one sequence (four on a GPU, one where
the CPU computes), on models too narrow to keep the device busy, and the cost model charges those
figures per layer and batch. This times the same narrow models over the batch shapes real policies
run (more batches; a cache travelling from host memory; one row of each batch on disk; 4-bit cache
and weights), and sets beside each what the cost model charges for it on a profile. Where they differ, the planner's choice between many small
batches and a few large ones is off (an OPT-66B decode of 20 batches ran host-bound, a fifth over
its charge).

    python bench/host_per_batch.py [--hardware h100] [--repeats 3] [--offload-dir /tmp/off] [--only TEXT]
                                   [--cprofile DIR] [--family opt|llama]

`--cprofile DIR` also runs each case's deeper model once more under cProfile and writes where the
main thread's time went (by own time and by cumulative time) to a file per case in DIR.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexoff.profiler.host_overhead import (  # noqa: E402
    DEPTHS, LLAMA_FIELDS, OPT_FIELDS, PROMPT_LEN, STEPS, decode_seconds_per_layer, probe_sequences,
)
from flexoff.models.config import ModelConfig  # noqa: E402
from flexoff.planner.cost_model import CostModel, Workload  # noqa: E402
from flexoff.planner.hardware import resolve_hardware  # noqa: E402
from flexoff.planner.report import policy_summary  # noqa: E402
from flexoff.policy import CompressionConfig, Policy, TierFractions  # noqa: E402
from flexoff.runtime.engine import Engine  # noqa: E402
from flexoff.weights.dummy import DummyWeights  # noqa: E402

GPU, CPU = TierFractions(1, 0, 0), TierFractions(0, 1, 0)
FOUR_BIT = CompressionConfig(4, 64)


def cases() -> list[Policy]:
    """Batch shapes (rows x batches) and placements; disk rows are one row of each batch."""
    travelling = dict(compress_cache=FOUR_BIT, compress_weight=FOUR_BIT)
    shapes = [(1, 1), (4, 8), (12, 20), (56, 4)]
    policies = [Policy(rows, batches, GPU, GPU, GPU) for rows, batches in shapes[:2]]
    policies += [Policy(rows, batches, GPU, CPU, GPU, **travelling) for rows, batches in shapes]
    policies += [Policy(rows, batches, GPU, TierFractions(0, 1 - 1 / rows, 1 / rows), GPU, **travelling)
                 for rows, batches in shapes[1:]]
    return policies


FAMILIES = {"opt": OPT_FIELDS, "llama": LLAMA_FIELDS}  # llama: grouped-query attention, RoPE, SwiGLU


def deeper_model(fields: dict) -> ModelConfig:
    """The deeper of the two narrow models a case is timed on: the one charged and profiled."""
    return ModelConfig(name="host-per-batch", num_layers=DEPTHS[1], **fields)


def charged(policy: Policy, hardware, fields: dict) -> float:
    """What the cost model charges the host per decode layer and batch, for the deeper model."""
    config = deeper_model(fields)
    workload = Workload(PROMPT_LEN, STEPS + 1, policy.block_size)
    return CostModel(config, workload, hardware).predict(policy).decode.io["host"] / policy.num_gpu_batches


def profile_calls(device, dtype, policy: Policy, fields: dict, offload: str, path: Path) -> None:
    """One run of the deeper model under cProfile, after a warm-up run, written to ``path``: the
    functions by own time and by cumulative time, with the calls per decode layer and batch."""
    engine = Engine(deeper_model(fields), DummyWeights(0), policy, device, dtype, offload_dir=offload)

    def block() -> None:
        engine.generate_block(probe_sequences(policy.block_size))

    try:
        block()  # warm-up
        profiler = cProfile.Profile()
        profiler.enable()
        block()
        profiler.disable()
    finally:
        engine.close()
    layer_batches = (STEPS + 1) * DEPTHS[1] * policy.num_gpu_batches
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"{policy_summary(policy)}\n{stats.total_calls} calls, {stats.total_calls / layer_batches:.0f} "
               f"per layer and batch ({layer_batches} layer-batches, prefill included)\n")
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(45)
    path.write_text(text.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="h100", help="the profile whose charges to show (default h100)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per depth; the best counts")
    parser.add_argument("--offload-dir", default=None, help="where disk rows go (default: a temporary folder)")
    parser.add_argument("--only", action="append", metavar="TEXT",
                        help="time only the policies whose summary holds TEXT (e.g. 'c 0/75/25'); repeatable")
    parser.add_argument("--cprofile", type=Path, metavar="DIR",
                        help="also write each case's cProfile of the main thread to a file in DIR")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="opt",
                        help="the narrow model's family (default opt)")
    args = parser.parse_args()
    fields = FAMILIES[args.family]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    hardware = resolve_hardware(args.hardware)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (the compute device: host and work mix)"
    print(f"device: {name}; model: {args.family}, hidden {fields['hidden_size']}, {DEPTHS} layers; "
          f"charges from the `{args.hardware}` profile")
    print("| policy | host ms per layer and batch, measured | charged | measured / charged |")
    print("| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as offload:
        for policy in cases():
            if args.only and not any(text in policy_summary(policy) for text in args.only):
                continue
            rows = policy.block_size
            per_layer, _ = decode_seconds_per_layer(device, dtype, policy, fields, args.repeats, sequences=rows,
                                                    offload_dir=offload)
            measured, price = per_layer / policy.num_gpu_batches, charged(policy, hardware, fields)
            print(f"| {policy_summary(policy)} | {measured * 1e3:.3f} | {price * 1e3:.3f} | {measured / price:.2f} |",
                  flush=True)
            if args.cprofile:
                args.cprofile.mkdir(parents=True, exist_ok=True)
                name = re.sub(r"[^A-Za-z0-9.]+", "_", policy_summary(policy)).strip("_")
                profile_calls(device, dtype, policy, fields, offload, args.cprofile / f"{name}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
