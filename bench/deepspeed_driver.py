"""DeepSpeed ZeRO-Inference, the way its documentation runs a model too big for the card: ZeRO stage 3 with every
parameter offloaded to pinned CPU memory and fetched layer by layer, weights quantized to 4 bits in groups of 64
at initialization (``weight_quantization.quantized_initialization``, DeepSpeed's INT4 ZeRO-Inference), prefetch
buckets of two hidden-by-hidden matrices, at the largest batch that fits the GPU cap.

The model (a registry size, built by transformers from its config: bench/hf_models.py) is constructed inside
``deepspeed.zero.Init``, so its parameters are partitioned and moved to the host as each module is built, never
all on the GPU. Its weights are transformers' random initialization; nothing is downloaded. One process, a
world of one (on a machine without CUDA, DeepSpeed's CPU accelerator and gloo). What the documentation's
configuration has that cannot be enabled here is named in the result's ``not_enabled``: ZeRO-Inference's
KV-cache offload is not part of DeepSpeed's library (it lives in patched transformers model code of the
DeepSpeedExamples repository, for transformers 4), so the cache stays on the GPU.

The last line of output is ``HF_RESULT {json}`` (bench/hf_accelerate_driver.py's format): prefill / decode /
total token/s as FlexGen counts them, peak GPU memory, the batch, the DeepSpeed and transformers versions and
the configuration; or ``{"error": "cannot run: ..."}``.

    python bench/deepspeed_driver.py --model llama-3-70b --gpu-mem 24GiB --prompt-len 512 --gen-len 32
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_accelerate_driver import (BATCHES, batch_ladder, driver_parser, emit, generate,  # noqa: E402
                                  per_sequence_bytes, progress, time_largest_batch)
from hf_models import Unmapped, hf_config  # noqa: E402
from flexoff.models import REGISTRY  # noqa: E402
from flexoff.planner.sizes import parameter_count  # noqa: E402
from flexoff.units import parse_size  # noqa: E402

GiB = 2**30
NOT_ENABLED = {"kv_cache_offload": "not in DeepSpeed's library: ZeRO-Inference's KV offload is patched model code "
                                   "of DeepSpeedExamples for transformers 4"}


def ds_config(hidden: int, quant_bits: int | None, dtype: str) -> dict:
    """ZeRO-Inference's configuration: stage 3, parameters on pinned host memory, 4-bit weights."""
    config = {
        "train_micro_batch_size_per_gpu": 1,
        dtype: {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "stage3_prefetch_bucket_size": 2 * hidden * hidden,
            "stage3_param_persistence_threshold": hidden,
            "stage3_max_live_parameters": 2 * hidden * hidden,
        },
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }
    if quant_bits:
        config["weight_quantization"] = {"quantized_initialization": {
            "num_bits": quant_bits, "group_size": 64, "group_dim": 1, "symmetric": False}}
    return config


def not_enabled(cfg, quant_bits: int, quantized: int, dtype: str) -> dict:
    """What of ZeRO-Inference's configuration this run lacks, and why."""
    missing = dict(NOT_ENABLED)
    if quant_bits and not quantized:
        missing["weight_quantization"] = "DeepSpeed quantized no parameter of this model"
    elif quant_bits and cfg.num_experts:
        missing["expert_quantization"] = (f"DeepSpeed quantizes nn.Linear and nn.Embedding weights only; "
                                          f"transformers keeps a layer's experts in 3-D parameters, which stay {dtype}")
    return missing


def world_of_one() -> None:
    """The environment torch.distributed reads, for one process on this machine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)


def plain_arch_list(arch_list: str) -> str:
    """TORCH_CUDA_ARCH_LIST without the architecture-specific suffixes ("9.0a", "10.0f") newer torch builds
    name, which DeepSpeed's JIT op builder reads as numbers and fails on; "+PTX" it does read."""
    parts = [part.strip() for part in arch_list.replace(";", " ").split() if part.strip()]
    return ";".join(dict.fromkeys(re.sub(r"(?<=\d)[af](?=$|\+)", "", part) for part in parts))


def build(cfg, config: dict):
    """The model, built inside zero.Init and wrapped by deepspeed.initialize, in eval mode."""
    import deepspeed
    import torch
    from transformers.integrations import HfDeepSpeedConfig

    hf_cfg, model_class = hf_config(cfg)
    # While it lives, transformers builds models inside zero.Init with this configuration (quantization
    # included) and initializes their partitioned weights as ZeRO-3 needs.
    keep = HfDeepSpeedConfig(config)
    model = model_class._from_config(hf_cfg, dtype=torch.float16 if "fp16" in config else torch.bfloat16)
    engine = deepspeed.initialize(model=model, config_params=config)[0]
    engine.module.eval()
    engine.module._keep_ds_config = keep
    return engine.module


def main() -> None:
    parser = driver_parser(__doc__, "llama-3-70b")
    parser.add_argument("--quant-bits", type=int, choices=[0, 4, 8], default=4,
                        help="weight bits at initialization, 0 for fp16 (default 4)")
    args = parser.parse_args()
    cfg = REGISTRY[args.model]

    import torch

    try:
        import deepspeed
        import transformers
    except ImportError as error:
        emit({"error": f"cannot run: {error}"})
        return
    world_of_one()
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    cap = None
    if device != "cpu":
        # An fp16 model's 4-bit embedding dequantizes through a CUDA op DeepSpeed compiles on first use.
        major, minor = torch.cuda.get_device_capability(0)
        os.environ["TORCH_CUDA_ARCH_LIST"] = plain_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}"))
        total = torch.cuda.get_device_properties(0).total_memory
        cap = min(total, parse_size(args.gpu_mem)) if args.gpu_mem else total
        torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    # The model's own 16-bit format; DeepSpeed's CPU accelerator has no fp16.
    dtype = "fp16" if cfg.native_dtype == "float16" and device != "cpu" else "bf16"
    config = ds_config(cfg.hidden_size, args.quant_bits or None, dtype)
    try:
        model = build(cfg, config)
    except Unmapped as error:
        emit({"error": f"cannot run: {error}"})
        return
    progress(f"{type(model).__name__} under ZeRO-3: {parameter_count(cfg) / 1e9:.1f}B parameters on the host")
    generate(model, 1, 32, 2, cfg.pad_token_id, device)  # warm up: the first fetches, kernels, the allocator
    # DeepSpeed marks each matrix it quantized.
    quantized = sum(1 for p in model.parameters() if getattr(p, "weight_quantized", False))
    described = {"deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                 "weights": f"int{args.quant_bits} in groups of 64 ({quantized} matrices), the rest {dtype}"
                 if quantized else dtype,
                 "offload": "ZeRO-3 parameters on pinned CPU memory",
                 "not_enabled": not_enabled(cfg, args.quant_bits, quantized, dtype)}
    positions = args.prompt_len + args.gen_len
    if args.batch_sizes:
        ladder = [int(b) for b in args.batch_sizes.split(",")]
    elif cap is None:
        ladder = [1]
    else:
        live = 2 * config["zero_optimization"]["stage3_max_live_parameters"] * 2  # two buckets in flight
        free = cap - torch.cuda.memory_allocated(0) - live
        ladder = batch_ladder(free * 0.8 / per_sequence_bytes(cfg, positions, args.prompt_len), largest=BATCHES[-1])
    time_largest_batch(model, cfg, ladder, args.prompt_len, args.gen_len, described, device)


if __name__ == "__main__":
    main()
