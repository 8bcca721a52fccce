"""The runtime's host time per decoder layer: what the profiler measures of the host, apart from the
work it launches (the cost model's host terms)."""

from __future__ import annotations

import torch


# Models too narrow to keep a device busy (head_dim 64: compression's groups of 64 take the same
# kernels as in real models): an OPT one, a Llama-family one, and one with 8 experts, 2 a token.
OPT_FIELDS = dict(family="opt", vocab_size=512, hidden_size=128, num_heads=2, intermediate_size=512, max_positions=64)
LLAMA_FIELDS = dict(OPT_FIELDS, family="llama", num_kv_heads=1, tie_word_embeddings=False)
SPARSE_FIELDS = dict(LLAMA_FIELDS, num_experts=8, experts_per_token=2, expert_intermediate_size=256)
DEPTHS = (2, 10)
STEPS = 24  # decode steps timed a run
PROMPT_LEN = 8  # tokens of each timed sequence's prompt
DISK_BATCHES = 4  # GPU batches the disk rows' extra is timed over
GPU_BATCHES = 4  # GPU batches a GPU's host figures are timed over


def decode_seconds_per_layer(compute: torch.device, dtype, policy, fields: dict, repeats: int = 3,
                             sequences: int = 1, offload_dir: str | None = None) -> tuple[float, dict[int, float]]:
    """(seconds per layer, {layers: seconds per step}) of decoding ``sequences`` sequences under
    ``policy`` through a model of ``fields`` at the two DEPTHS: the slope over depth is per layer.
    ``offload_dir``: where a policy with disk rows keeps them."""
    return decode_seconds_by_case(compute, dtype, {None: (policy, fields, sequences)}, repeats, offload_dir)[None]


def probe_sequences(count: int, steps: int = STEPS) -> list:
    """The ``count`` sequences a timed block runs: prompts of PROMPT_LEN tokens, each generating
    ``steps`` + 1 tokens (the prefill's, then ``steps`` decode steps)."""
    from ..runtime.batch import Sequence
    from ..runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    return [Sequence(i, [5] * PROMPT_LEN, params, 0) for i in range(count)]


def decode_seconds_by_case(compute: torch.device, dtype, cases: dict, repeats: int = 3,
                           offload_dir: str | None = None, deadline=None, steps: int = STEPS,
                           depths: tuple[int, int] = DEPTHS) -> dict:
    """{name: (seconds per layer, {layers: seconds per step})} for each case ``name: (policy,
    fields, sequences)``, as ``decode_seconds_per_layer`` times one. Every engine is built first,
    then timed in rounds, one run of each a round, each keeping its best: the cases' figures are
    differences of each other, and drift in the machine (clocks, caches, other processes) then
    falls on all of them alike instead of on the ones timed last. The warm-up round runs one decode
    step (each runs the same kernels). Once ``deadline`` (a ``profile_kernels.Deadline``) has
    passed, no round starts after the first timed one. ``steps``: decode steps a timed run;
    ``depths``: the two layer counts, for DEPTHS."""
    from ..models.config import ModelConfig
    from ..runtime.engine import Engine
    from ..weights.dummy import DummyWeights

    engines, sequences = {}, {}
    weights = DummyWeights(0)  # one pool of random values for all: each engine would draw its own
    try:
        for name, (policy, fields, count) in cases.items():
            for layers in depths:
                config = ModelConfig(name=f"host-overhead-{layers}", num_layers=layers, **fields)
                engines[name, layers] = Engine(config, weights, policy, compute, dtype, offload_dir=offload_dir)
                sequences[name, layers] = count
        best = {key: float("inf") for key in engines}
        for key, engine in engines.items():  # warm-up
            engine.generate_block(probe_sequences(sequences[key], 1))
        for round_ in range(repeats):
            if round_ and deadline is not None and deadline.passed():
                break
            for key, engine in engines.items():
                seconds = engine.generate_block(probe_sequences(sequences[key], steps)).decode_time / steps
                best[key] = min(best[key], seconds)
    finally:
        for engine in engines.values():
            engine.close()
        weights.close()
    low, high = depths
    return {name: ((best[name, high] - best[name, low]) / (high - low), {layers: best[name, layers] for layers in depths})
            for name in cases}


def host_overhead(compute: torch.device, dtype, repeats: int = 3, offload_dir: str | None = None,
                  batches: int = 1, deadline=None, steps: int = STEPS, depths: tuple[int, int] = DEPTHS):
    """The runtime's host time per decoder layer and GPU batch, and per decode step of a batch, apart
    from the work itself: decode of ``batches`` GPU batches of one sequence each through models too
    narrow (hidden 128) to keep the device busy, at two depths. The slope over depth per batch is per
    layer, the rest per step (embedding, head, sampling). All on the device first; then the extra per
    layer and batch of a cache that travels, of a travelling cache that is compressed, of that cache
    on disk (under ``offload_dir``, over DISK_BATCHES batches), of a Llama-family layer over an OPT
    one, and of a sparse MLP (8 experts, 2 a token) over a dense gated one; and of compressed
    weights per pass over them (several batches make one). A GPU's policies run many batches a layer,
    and a lone batch misses host work each of them adds (it priced a 20-batch decode a fifth under
    its host's time); where the CPU is the compute device, it runs one. ``deadline``, ``steps`` and
    ``depths``: as ``decode_seconds_by_case`` takes them."""
    from dataclasses import replace

    from ..policy import CompressionConfig, Policy, TierFractions

    gpu, cpu, disk = TierFractions(1, 0, 0), TierFractions(0, 1, 0), TierFractions(0, 0, 1)
    four_bit = CompressionConfig(4, 64)
    on_device = Policy(1, batches, gpu, gpu, gpu)
    travelling = replace(on_device, cache=cpu, compress_cache=four_bit)
    # Disk rows against host rows over several batches: each batch's reads and writes run on
    # helper threads beside the main thread, and over one batch they overlap the others less.
    several = replace(travelling, num_gpu_batches=DISK_BATCHES)
    variants = {
        "on the device": (on_device, OPT_FIELDS),
        "cache travels": (replace(on_device, cache=cpu), OPT_FIELDS),
        "compressed cache travels": (travelling, OPT_FIELDS),
        "compressed weights": (replace(on_device, compress_weight=four_bit), OPT_FIELDS),
        "llama": (on_device, LLAMA_FIELDS),
        "sparse": (on_device, SPARSE_FIELDS),
        "compressed cache on disk, several batches": (replace(several, cache=disk), OPT_FIELDS),
    }
    disk_reference = "compressed cache travels"
    if batches != DISK_BATCHES:
        disk_reference = "compressed cache travels, several batches"
        variants[disk_reference] = (several, OPT_FIELDS)
    measured = decode_seconds_by_case(
        compute, dtype, {name: (policy, fields, policy.gpu_batch_size * policy.num_gpu_batches)
                         for name, (policy, fields) in variants.items()}, repeats, offload_dir, deadline, steps,
        depths)
    # per layer and GPU batch
    slope = {name: per_layer / variants[name][0].num_gpu_batches for name, (per_layer, _) in measured.items()}
    seconds = {name: per_step for name, (_, per_step) in measured.items()}
    # A profile holds positive figures: noise that hides one leaves it a nanosecond.
    per_layer = max(1e-9, slope["on the device"])
    step = max(1e-9, seconds["on the device"][depths[0]] / batches - depths[0] * per_layer)
    extras = {
        "host_seconds_per_travelling_layer": slope["cache travels"] - slope["on the device"],
        "host_seconds_per_compressed_cache_layer": slope["compressed cache travels"] - slope["cache travels"],
        # per pass over a layer's compressed weights, which the batches of a layer make once
        "host_seconds_per_compressed_weight_layer": (slope["compressed weights"] - slope["on the device"]) * batches,
        "host_seconds_per_disk_rows_layer": slope["compressed cache on disk, several batches"] - slope[disk_reference],
        "host_seconds_per_llama_layer": slope["llama"] - slope["on the device"],
        "host_seconds_per_sparse_layer": slope["sparse"] - slope["llama"],
    }
    record = {"decode_seconds_per_step": {name: {str(k): v for k, v in t.items()} for name, t in seconds.items()},
              "hidden": 128, "sequences": 1, "gpu_batches": batches, "steps": steps, "depths": list(depths)}
    return per_layer, step, {key: max(1e-9, value) for key, value in extras.items()}, record
