"""HF transformers + Accelerate with CPU offload, the way a user without flexoff runs a model too big for the card.

The model is built from its OPT config on the meta device with random fp16 weights (nothing is downloaded),
placed by ``infer_auto_device_map`` under ``max_memory`` {0: part of the GPU cap, "cpu": the host's share},
and dispatched with CPU offload: every forward streams the CPU layers to the GPU. It runs at the largest
batch that fits the GPU cap, found from large to small by a probe at the longest context. The last line of
output is ``HF_RESULT {json}``: prefill / decode / total token/s as FlexGen counts them, peak GPU memory,
peak RSS, the batch; or ``{"error": "cannot run: ..."}``.

    python bench/hf_accelerate_driver.py --model opt-30b --gpu-mem 16GiB --prompt-len 512 --gen-len 32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexoff.models import REGISTRY  # noqa: E402
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


def per_sequence_bytes(cfg, positions: int, prompt_len: int) -> int:
    """GPU bytes one sequence needs at the longest context: its KV cache in every layer, and prefill's
    largest activations (fc1's output, the attention scores where they are materialised, a few hidden states)."""
    cache = 2 * cfg.num_layers * cfg.hidden_size * positions * 2
    activations = prompt_len * (cfg.intermediate_size + cfg.num_heads * prompt_len + 4 * cfg.hidden_size) * 2
    return cache + activations


def host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def emit(result: dict) -> None:
    print(MARK + json.dumps(result), flush=True)


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


def build_model(cfg, gpu_weight_bytes: int, host_budget: int):
    """The OPT model on meta, placed by Accelerate, each parameter filled on its device, then dispatched."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import OPTConfig, OPTForCausalLM

    hf_config = OPTConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                          num_attention_heads=cfg.num_heads, ffn_dim=cfg.intermediate_size,
                          max_position_embeddings=cfg.max_positions, word_embed_proj_dim=cfg.word_embed_proj_dim,
                          do_layer_norm_before=cfg.do_layer_norm_before, pad_token_id=cfg.pad_token_id,
                          bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_ids[0])
    with init_empty_weights():
        model = OPTForCausalLM(hf_config).to(torch.float16)
    model.eval()
    device_map = infer_auto_device_map(model, max_memory={0: gpu_weight_bytes, "cpu": host_budget},
                                       no_split_module_classes=["OPTDecoderLayer"], dtype=torch.float16)
    if "disk" in device_map.values():
        return None, device_map
    pools = {}

    def fill(name, tensor_shape, device):
        # Random values, cheaply: one random pool per device, copied over and over (speed does not
        # depend on the values, and drawing 60 GB of normals would take minutes).
        pool = pools.setdefault(device, torch.randn(1 << 24, dtype=torch.float16, device=device) * 0.02)
        value = torch.empty(tensor_shape, dtype=torch.float16, device=device)
        flat = value.view(-1)
        for start in range(0, flat.numel(), pool.numel()):
            piece = flat[start:start + pool.numel()]
            piece.copy_(pool[:piece.numel()])
        set_module_tensor_to_device(model, name, device, value=value)

    def device_of(name):
        owner = max((key for key in device_map if key == "" or name == key or name.startswith(key + ".")), key=len)
        where = device_map[owner]
        return "cpu" if where == "cpu" else f"cuda:{where}" if isinstance(where, int) else where

    for name, param in list(model.named_parameters()):
        fill(name, param.shape, device_of(name))
    model.tie_weights()  # filling replaced the shared embedding: tie the head to it again
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if param.device.type == "meta":
            fill(name, param.shape, device_of(name))
    pools.clear()
    return dispatch_model(model, device_map=device_map, main_device=0), device_map


def generate(model, batch: int, prompt_len: int, gen_len: int, pad_id: int, device: str = "cuda:0"):
    """Greedy generation of gen_len tokens for batch prompts of prompt_len; (prefill s, decode s)."""
    import torch

    ids = torch.full((batch, prompt_len), 100, dtype=torch.long, device=device)
    ids[:, 0] = 2
    ids[:, 1:] += torch.arange(prompt_len - 1, device=device) % 997
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="opt-30b", help="an OPT model of flexoff's registry, e.g. opt-30b")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--gpu-mem", help="cap the GPU memory, e.g. 16GiB (default: the whole card)")
    parser.add_argument("--batch-sizes", help="comma-separated batch sizes to try, largest first "
                                              "(default: from just above the memory estimate down to 1)")
    args = parser.parse_args()
    cfg = REGISTRY[args.model]
    if cfg.family != "opt":
        emit({"error": f"cannot run: this driver builds OPT models, not {cfg.family}"})
        return

    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    cap = min(total, parse_size(args.gpu_mem)) if args.gpu_mem else total
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    gpu_weights, host = int(GPU_WEIGHT_SHARE * cap), host_bytes()
    verdict = host_verdict(2 * parameter_count(cfg), gpu_weights, host)
    if verdict:
        emit({"error": verdict})
        return
    model, device_map = build_model(cfg, gpu_weights, int(HOST_SHARE * host) - PROCESS_OVERHEAD)
    if model is None:
        emit({"error": "cannot run: Accelerate would put part of the model on disk"})
        return
    on_gpu = sum(p.numel() * 2 for p in model.parameters() if p.device.type == "cuda")
    free = cap - torch.cuda.memory_allocated(0)
    positions = args.prompt_len + args.gen_len
    estimate = free * 0.8 / per_sequence_bytes(cfg, positions, args.prompt_len)
    ladder = ([int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes
              else batch_ladder(estimate, largest=256))
    print(f"weights on the GPU {on_gpu / GiB:.1f} GiB, {free / GiB:.1f} GiB left; batches to try {ladder}",
          flush=True)
    generate(model, 1, 32, 1, cfg.pad_token_id)  # warm-up: kernels, allocator, the hooks' first copies
    for batch in ladder:
        try:
            # Probe: a prefill at the longest context needs at least the timed run's GPU memory, in one forward.
            generate(model, batch, positions - 1, 1, cfg.pad_token_id)
            torch.cuda.reset_peak_memory_stats(0)
            prefill, decode = generate(model, batch, args.prompt_len, args.gen_len, cfg.pad_token_id)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as error:
            # cuBLAS reports a failed allocation as a RuntimeError of its own.
            if not isinstance(error, torch.cuda.OutOfMemoryError) and "ALLOC_FAILED" not in str(error):
                raise
            print(f"batch {batch}: out of GPU memory", flush=True)
            del error
            gc.collect()
            torch.cuda.empty_cache()
            continue
        emit({"prefill": batch * args.prompt_len / prefill,
              "decode": batch * (args.gen_len - 1) / max(decode, 1e-10),
              "total": batch * args.gen_len / (prefill + decode),
              "gpu_peak": torch.cuda.max_memory_allocated(0), "batch": batch, "gpu_weights": on_gpu,
              "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
        return
    emit({"error": f"cannot run: out of GPU memory at batch {ladder[-1]}"})


if __name__ == "__main__":
    main()
