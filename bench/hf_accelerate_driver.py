"""HF transformers + Accelerate with CPU offload, the way a user without flexoff runs a model too big for the card.

The model (any registry size: OPT, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE) is built from its
transformers config (bench/hf_models.py) on the meta device with random fp16 weights (nothing is downloaded),
placed by ``infer_auto_device_map`` under ``max_memory`` {0: part of the GPU cap, "cpu": the host's share},
and dispatched with CPU offload: every forward streams the CPU layers to the GPU. It runs at the largest
batch that fits the GPU cap, found from large to small by a probe at the longest context. Progress goes to
stderr. The last line of output is ``HF_RESULT {json}``: prefill / decode / total token/s as FlexGen counts
them, peak GPU memory, peak RSS, the batch, the transformers version and its attention and experts kernels;
or ``{"error": "cannot run: ..."}``.

    python bench/hf_accelerate_driver.py --model mixtral-8x7b --gpu-mem 16GiB --prompt-len 512 --gen-len 32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_models import Unmapped, hf_config, no_split_modules  # noqa: E402
from flexoff.models import REGISTRY, Stage, stage_specs  # noqa: E402
from flexoff.planner.sizes import parameter_count  # noqa: E402
from flexoff.units import parse_size  # noqa: E402

MARK = "HF_RESULT "
GiB = 2**30
# The host memory a run may use: the rest is the OS's, the page cache's and the bench process's.
HOST_SHARE = 0.85
# Host memory of the process beyond its CPU weights: torch, CUDA's host-side state, the Python heap.
PROCESS_OVERHEAD = 4 * GiB
# Of the GPU cap, the share Accelerate may fill with weights: the rest holds the cache, the activations and
# the offloaded layer being run, which decide the batch (OPT-30B's cache is 0.75 GiB a sequence at 544 tokens).
GPU_WEIGHT_SHARE = 0.25
BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def host_verdict(weight_bytes: int, gpu_weight_bytes: int, host_bytes: int) -> str | None:
    """Why the fp16 weights cannot be held (without a disk tier) on this host, or None when they can."""
    need = max(0, weight_bytes - gpu_weight_bytes) + PROCESS_OVERHEAD
    if need <= HOST_SHARE * host_bytes:
        return None
    return (f"cannot run: needs {need / GiB:.0f} GiB of host memory "
            f"({host_bytes / GiB:.0f} GiB host, {HOST_SHARE * host_bytes / GiB:.0f} GiB usable)")


def batch_ladder(estimate: float, largest: int) -> list[int]:
    """Batch sizes to try, largest first: from one step above the memory estimate (estimates err) down to 1."""
    sizes = [b for b in BATCHES if b <= largest]
    above = [b for b in sizes if b > estimate]
    top = above[0] if above else sizes[-1]
    return [b for b in reversed(sizes) if b <= top]


def per_sequence_bytes(cfg, positions: int, prompt_len: int, grouped_experts: bool = True) -> int:
    """GPU bytes one sequence needs at the longest context: its KV cache in every layer, and prefill's
    largest activations (the MLP's widest intermediates, the attention scores where they are materialised,
    a few hidden states)."""
    cache = cfg.num_layers * cfg.kv_elements_per_token_per_layer * positions * 2
    activations = prompt_len * (mlp_elements_per_token(cfg, grouped_experts)
                                + cfg.num_heads * prompt_len + 4 * cfg.hidden_size) * 2
    return cache + activations + prompt_len * routing_bytes_per_token(cfg)


def mlp_elements_per_token(cfg, grouped_experts: bool) -> int:
    """Elements a token's MLP holds at once in prefill, the widest layer's.

    OPT: fc1's output. A gated MLP: gate, up and their product. A sparse layer: each of the token's
    top-k expert rows holds its gate and up, their product, its input and its output (hidden), all at
    once where HF groups the experts into one kernel; where it loops over experts, one expert's rows
    at a time, about 2k/E of a token (twice the balanced share: random routers are not balanced),
    plus the shared expert's gated MLP (Qwen2-MoE)."""
    if cfg.family == "opt":
        return cfg.intermediate_size
    dense = 3 * cfg.intermediate_size if cfg.num_experts == 0 or cfg.dense_layers else 0
    if not cfg.num_experts:
        return dense
    rows = cfg.experts_per_token if grouped_experts else min(1.0, 2 * cfg.experts_per_token / cfg.num_experts)
    sparse = rows * (3 * cfg.expert_intermediate_size + 2 * cfg.hidden_size) + 3 * cfg.shared_expert_intermediate_size
    return int(max(dense, sparse))


def routing_bytes_per_token(cfg) -> int:
    """A token's router tensors in a sparse layer: logits (fp16), their softmax (fp32), and the one-hot
    expert mask (int64, tokens x k x experts) transformers 4.x builds to find each expert's tokens."""
    if not cfg.num_experts:
        return 0
    return cfg.num_experts * (2 + 4) + cfg.experts_per_token * cfg.num_experts * 8


def largest_layer_bytes(cfg) -> int:
    """fp16 bytes of the largest decoder layer: what the offload hooks bring to the GPU for one forward."""
    kinds = {cfg.sparse_layer(i): i for i in range(cfg.num_layers)}  # one layer of each MLP kind
    return 2 * max(sum(spec.numel for spec in stage_specs(cfg, Stage("layer", i))) for i in kinds.values())


def host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def emit(result: dict) -> None:
    print(MARK + json.dumps(result), flush=True)


_START = time.perf_counter()


def progress(message: str) -> None:
    """A line on stderr with the seconds since start: building 90 GB of weights takes minutes."""
    print(f"[{time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)


class PrefillClock:
    """A streamer that notes when generate hands over its first new token: the end of prefill. Its first
    call is the prompt itself; each later one follows a copy of the tokens to the host, so it is synchronous."""

    def __init__(self):
        self.calls, self.first_token = 0, None

    def put(self, _tokens):
        self.calls += 1
        if self.calls == 2:
            self.first_token = time.perf_counter()

    def end(self):
        pass


def meta_model(cfg, empty_weights=None):
    """The transformers model of ``cfg`` on the meta device, fp16, in eval mode; refused (Unmapped) where
    the installed transformers builds other parameters than flexoff counts (an older class without a
    field, say): the baseline must run the same model. ``empty_weights`` makes the context that puts new
    parameters on meta: Accelerate's, which keeps buffers (RoPE's frequencies) real, by default."""
    import torch
    import transformers

    if empty_weights is None:
        from accelerate import init_empty_weights as empty_weights

    config, model_class = hf_config(cfg)
    with empty_weights():
        model = model_class(config).to(torch.float16)
    model.tie_weights()  # transformers 5 leaves a tied head its own parameter when built on meta
    built, expected = sum(p.numel() for p in model.parameters()), parameter_count(cfg)
    if built != expected:
        raise Unmapped(f"transformers {transformers.__version__}'s {model_class.__name__} has {built:,} "
                       f"parameters where flexoff's {cfg.name} has {expected:,}")
    return model.eval()


def materialise(model, device_of, report=progress) -> None:
    """Give every meta parameter random fp16 values on its device (``device_of(name)``), in place.

    Cheaply: one random pool per device, each tensor a window of it (at an offset of its name's, so
    layers' routers differ) copied over and over (speed does not depend on the values, as long as
    routers are not constant, and drawing 90 GB of normals would take minutes)."""
    import torch

    pools, window = {}, 1 << 24
    params = [(name, p) for name, p in model.named_parameters() if p.device.type == "meta"]
    total, done, last = sum(p.numel() for _, p in params) * 2, 0, time.perf_counter()

    def fill(name, shape):
        device = device_of(name)
        if device not in pools:  # once per device (setdefault would draw a new pool for every tensor)
            pools[device] = torch.randn(2 * window, dtype=torch.float16, device=device) * 0.02
        offset = zlib.crc32(name.encode()) % window
        pool = pools[device][offset:offset + window]
        value = torch.empty(shape, dtype=torch.float16, device=device)
        flat = value.view(-1)
        for start in range(0, flat.numel(), pool.numel()):
            piece = flat[start:start + pool.numel()]
            piece.copy_(pool[:piece.numel()])
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
        return value.numel() * 2

    for name, param in params:
        done += fill(name, param.shape)
        if time.perf_counter() - last > 10:
            report(f"filled {done / GiB:.1f} of {total / GiB:.1f} GiB")
            last = time.perf_counter()
    model.tie_weights()  # filling replaced a shared embedding: tie the head to it again
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if param.device.type == "meta":  # a tie the model does not restore itself
            fill(name, param.shape)
    report(f"filled {total / GiB:.1f} GiB of weights")


def build_model(cfg, gpu_weight_bytes: int, host_budget: int):
    """The model on meta, placed by Accelerate, each parameter filled on its device, then dispatched;
    (None, device map) where Accelerate would need the disk."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map

    model = meta_model(cfg)
    progress(f"{type(model).__name__} on meta: {parameter_count(cfg) / 1e9:.1f}B parameters")
    device_map = infer_auto_device_map(model, max_memory={0: gpu_weight_bytes, "cpu": host_budget},
                                       no_split_module_classes=no_split_modules(model), dtype=torch.float16)
    if "disk" in device_map.values():
        return None, device_map

    def device_of(name):
        owner = max((key for key in device_map if key == "" or name == key or name.startswith(key + ".")), key=len)
        where = device_map[owner]
        return "cpu" if where == "cpu" else f"cuda:{where}" if isinstance(where, int) else where

    materialise(model, device_of)
    model = dispatch_model(model, device_map=device_map, main_device=0)
    progress("dispatched")
    return model, device_map


def generate(model, batch: int, prompt_len: int, gen_len: int, pad_id: int, device: str = "cuda:0"):
    """Greedy generation of gen_len tokens for batch prompts of prompt_len; (prefill s, decode s)."""
    import torch

    ids = torch.full((batch, prompt_len), 100, dtype=torch.long, device=device)
    ids[:, 0] = 2
    ids[:, 1:] += torch.arange(prompt_len - 1, device=device) % 997
    ids %= model.config.vocab_size  # the same ids for every real vocabulary; tiny test models have less
    clock = PrefillClock()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                       min_new_tokens=gen_len, do_sample=False, pad_token_id=pad_id, streamer=clock)
    sync()
    stop = time.perf_counter()
    first = clock.first_token or stop
    return first - start, stop - first


def warm_up(model, cfg) -> dict:
    """Run one short generation (kernels, allocator, the hooks' first copies); return the transformers
    version and the attention and experts kernels that ran. Where transformers' default experts kernel
    fails on fp16 (grouped matmuls are built for bf16 on some versions), the experts run eagerly, as
    the result then says."""
    import torch
    import transformers

    def kernel(kind):
        return getattr(model.config, f"_{kind}_implementation", None)

    kernels = {"transformers": transformers.__version__, "attention": kernel("attn"),
               "experts": kernel("experts") if cfg.num_experts else None}
    try:
        generate(model, 1, 32, 1, cfg.pad_token_id)
    except RuntimeError as error:
        if (isinstance(error, torch.cuda.OutOfMemoryError) or kernels["experts"] in (None, "eager")
                or not hasattr(model, "set_experts_implementation")):
            raise
        progress(f"the {kernels['experts']} experts kernel failed ({str(error).splitlines()[0][:120]}); eager instead")
        model.set_experts_implementation("eager")
        kernels["experts"] = f"eager ({kernels['experts']} failed)"
        generate(model, 1, 32, 1, cfg.pad_token_id)
    progress(f"warmed up: {kernels}")
    return kernels


def time_largest_batch(model, cfg, ladder: list[int], prompt_len: int, gen_len: int, described: dict,
                       device: str = "cuda:0") -> None:
    """Time a generation at the first batch of ``ladder`` whose probe fits, and emit its result with
    ``described``; a batch out of GPU memory gives way to the next."""
    import torch

    cuda = device.startswith("cuda")
    for batch in ladder:
        try:
            # Probe: a prefill at the longest context needs at least the timed run's GPU memory, in one forward.
            generate(model, batch, prompt_len + gen_len - 1, 1, cfg.pad_token_id, device)
            progress(f"batch {batch}: the probe fits; timing {gen_len} tokens")
            if cuda:
                torch.cuda.reset_peak_memory_stats(0)
            prefill, decode = generate(model, batch, prompt_len, gen_len, cfg.pad_token_id, device)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as error:
            # cuBLAS reports a failed allocation as a RuntimeError of its own.
            if not isinstance(error, torch.cuda.OutOfMemoryError) and "ALLOC_FAILED" not in str(error):
                raise
            print(f"batch {batch}: out of GPU memory", flush=True)
            del error
            gc.collect()
            torch.cuda.empty_cache()
            continue
        progress(f"batch {batch}: prefill {prefill:.1f} s, decode {decode:.1f} s")
        emit({"prefill": batch * prompt_len / prefill, "decode": batch * (gen_len - 1) / max(decode, 1e-10),
              "total": batch * gen_len / (prefill + decode),
              "gpu_peak": torch.cuda.max_memory_allocated(0) if cuda else 0, "batch": batch,
              "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **described})
        return
    emit({"error": f"cannot run: out of GPU memory at batch {ladder[-1]}"})


def driver_parser(description: str, example: str) -> argparse.ArgumentParser:
    """The flags every baseline driver takes: the model, the workload, the GPU cap and the batches to try."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-30b", help=f"a model of flexoff's registry, e.g. {example}")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--gpu-mem", help="cap the GPU memory, e.g. 16GiB (default: the whole card)")
    parser.add_argument("--batch-sizes", help="comma-separated batch sizes to try, largest first "
                                              "(default: from just above the memory estimate down to 1)")
    return parser


def main() -> None:
    parser = driver_parser(__doc__, "mixtral-8x7b")
    parser.add_argument("--experts", help="transformers 5's experts kernel, e.g. eager or grouped_mm "
                                          "(default: transformers' own choice)")
    args = parser.parse_args()
    cfg = REGISTRY[args.model]

    import torch
    import transformers

    total = torch.cuda.get_device_properties(0).total_memory
    cap = min(total, parse_size(args.gpu_mem)) if args.gpu_mem else total
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    gpu_weights, host = int(GPU_WEIGHT_SHARE * cap), host_bytes()
    verdict = host_verdict(2 * parameter_count(cfg), gpu_weights, host)
    if verdict:
        emit({"error": verdict})
        return
    try:
        model, device_map = build_model(cfg, gpu_weights, int(HOST_SHARE * host) - PROCESS_OVERHEAD)
    except Unmapped as error:
        emit({"error": f"cannot run: {error}"})
        return
    if model is None:
        emit({"error": "cannot run: Accelerate would put part of the model on disk"})
        return
    if args.experts and cfg.num_experts:
        if not hasattr(model, "set_experts_implementation"):
            emit({"error": f"cannot run: transformers {transformers.__version__} has no experts kernels to choose"})
            return
        model.set_experts_implementation(args.experts)
    kernels = warm_up(model, cfg)
    on_gpu = sum(p.numel() * 2 for p in model.parameters() if p.device.type == "cuda")
    # Room for sequences: the cap less the weights kept on the GPU and the offloaded layer being run.
    free = cap - torch.cuda.memory_allocated(0) - largest_layer_bytes(cfg)
    positions = args.prompt_len + args.gen_len
    grouped = kernels["experts"] is not None and not kernels["experts"].startswith("eager")
    estimate = free * 0.8 / per_sequence_bytes(cfg, positions, args.prompt_len, grouped)
    ladder = ([int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes
              else batch_ladder(estimate, largest=256))
    print(f"weights on the GPU {on_gpu / GiB:.1f} GiB, {free / GiB:.1f} GiB left beside a layer in flight; "
          f"{kernels}; batches to try {ladder}", flush=True)
    time_largest_batch(model, cfg, ladder, args.prompt_len, args.gen_len, {"gpu_weights": on_gpu, **kernels})


if __name__ == "__main__":
    main()
