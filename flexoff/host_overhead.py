"""The runtime's host time per decoder layer: what the profiler measures of the host, apart from the
work it launches (the cost model's host terms)."""

from __future__ import annotations

import torch


def host_overhead(compute: torch.device, dtype, repeats: int = 3):
    """The runtime's host time per decoder layer and per decode step of one GPU batch, apart from
    the work itself: decode of one sequence through models too narrow (hidden 128) to keep the
    device busy, at two depths. The slope over depth is per layer, the rest per step (embedding,
    head, sampling). All on the device first; then the extra per layer of a cache that travels, of
    a travelling cache that is compressed, and of compressed weights (the differences of slopes);
    and of a Llama-family layer over an OPT one, and of a sparse MLP (8 experts, 2 a token) over a
    dense gated one."""
    from .models.config import ModelConfig
    from .runtime.batch import Sequence
    from .runtime.engine import Engine
    from .policy import CompressionConfig, Policy, TierFractions
    from .runtime.sampling import SamplingParams
    from .weights.dummy import DummyWeights

    steps, depths = 24, (2, 10)
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    gpu, cpu, four_bit = TierFractions(1, 0, 0), TierFractions(0, 1, 0), CompressionConfig(4, 64)
    on_device = Policy(1, 1, gpu, gpu, gpu)
    # head_dim 64: compression's groups of 64 take the same kernels as in real models.
    opt = dict(family="opt", vocab_size=512, hidden_size=128, num_heads=2, intermediate_size=512, max_positions=64)
    llama = dict(opt, family="llama", num_kv_heads=1, tie_word_embeddings=False)
    sparse = dict(llama, num_experts=8, experts_per_token=2, expert_intermediate_size=256)
    variants = {
        "on the device": (on_device, opt),
        "cache travels": (Policy(1, 1, gpu, cpu, gpu), opt),
        "compressed cache travels": (Policy(1, 1, gpu, cpu, gpu, compress_cache=four_bit), opt),
        "compressed weights": (Policy(1, 1, gpu, gpu, gpu, compress_weight=four_bit), opt),
        "llama": (on_device, llama),
        "sparse": (on_device, sparse),
    }

    def per_step(policy: Policy, fields: dict, layers: int) -> float:
        config = ModelConfig(name=f"host-overhead-{layers}", num_layers=layers, **fields)
        engine = Engine(config, DummyWeights(0), policy, compute, dtype)
        try:
            times = []
            for _ in range(repeats + 1):  # the first run warms up
                seq = Sequence(0, [5] * 8, params, 0)
                times.append(engine.generate_block([seq]).decode_time / steps)
            return min(times[1:])
        finally:
            engine.close()

    low, high = depths
    seconds = {name: {layers: per_step(policy, fields, layers) for layers in depths}
               for name, (policy, fields) in variants.items()}
    # A profile holds positive figures: noise that hides one leaves it a nanosecond.
    slope = {name: (t[high] - t[low]) / (high - low) for name, t in seconds.items()}
    per_layer = max(1e-9, slope["on the device"])
    step = max(1e-9, seconds["on the device"][low] - low * per_layer)
    extras = {
        "host_seconds_per_travelling_layer": slope["cache travels"] - slope["on the device"],
        "host_seconds_per_compressed_cache_layer": slope["compressed cache travels"] - slope["cache travels"],
        "host_seconds_per_compressed_weight_layer": slope["compressed weights"] - slope["on the device"],
        "host_seconds_per_llama_layer": slope["llama"] - slope["on the device"],
        "host_seconds_per_sparse_layer": slope["sparse"] - slope["llama"],
    }
    measured = {"decode_seconds_per_step": {name: {str(k): v for k, v in t.items()} for name, t in seconds.items()},
                "hidden": 128, "sequences": 1, "steps": steps}
    return per_layer, step, {key: max(1e-9, value) for key, value in extras.items()}, measured
