"""llama.cpp as a baseline: its ``llama-batched-bench`` on a dummy Q4_0 GGUF (bench/dummy_gguf.py), with as much
of the model on the GPU as the bench's cap holds.

llama.cpp has no allocator cap, so the placement is planned here from the file's own tensor sizes and then
checked against the GPU memory nvidia-smi reports for the run's process, sampled while it runs (llama.cpp
allocates its buffers up front and keeps them). That figure holds the CUDA context, which torch's caps on the
other systems do not count; CONTEXT_ALLOWANCE of it is let pass. A run over the cap is not a result;
bench/throughput_runs.py runs it again with fewer layers on the GPU. (llama.cpp's own buffer lines need -v, and
with that many lines its logger, which is not flushed at exit, can lose the result line.)

The placement, as a user of llama.cpp sets it:
- dense models: ``-ngl N``, the first layers on the CPU and the last N on the GPU, each layer's KV cache on
  its layer's device; ``-ngl`` above the layer count puts the output layer on the GPU too. llama.cpp ships a
  CPU layer's weights to the GPU for batches of 32 tokens and more (its op offload), as an offloading engine does.
- mixtures of experts: every layer on the GPU (``-ngl 999``) but the experts of the first K layers, which stay on
  the CPU (``--n-cpu-moe K``), the setting llama.cpp's documentation gives for experts that do not fit.
Flash attention is on, the file is read into memory rather than mapped, and every sequence has its own KV
stream (llama.cpp's default, which pads each to 256 cells).

The run does the work of flexoff's and FlexGen's: a prompt of ``prompt_len`` per sequence, then ``gen_len - 1``
decode steps (the prompt's last logits give the first token). Throughputs are counted as FlexGen counts them:
prefill prompt tokens / prompt time, decode generated tokens after the first / decode time, total generated
tokens / the whole time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dummy_gguf import Tensor, stored_bytes, tensors

from flexoff.models import ModelConfig

BINARY = "llama-batched-bench"
BINARY_ENV = "LLAMACPP_BIN"
HOW_TO_GET = (f"build it from llama.cpp (cmake -B build -DGGML_CUDA=ON && cmake --build build --target {BINARY}) "
              f"and pass --llamacpp-bin PATH or set {BINARY_ENV}")
MiB = 2**20
# GPU memory beyond weights and cache before a run reports its compute buffer: the output logits and the
# weights of a CPU layer shipped over for a batch, plus activations for each token of a micro-batch.
COMPUTE_RESERVE = 1024 * MiB
# Tokens per micro-batch (-b and -ub). Every micro-batch of a prompt ships the weights left on the CPU to the
# GPU once, so a larger one divides prefill's traffic: 4096 ships them 8 times, not 64, for 64 prompts of 512.
UBATCH = 4096
KV_BYTES = 2  # the cache in f16, llama.cpp's default
CONTEXT_PAD = 256
CONTEXT_ALLOWANCE = 512 * MiB
GPU_QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


class Missing(RuntimeError):
    """The binary is not where the bench was told, nor on PATH."""


def find_binary(path: str | None) -> Path:
    """The llama-batched-bench to run: ``path``, else $LLAMACPP_BIN, else the one on PATH."""
    chosen = path or os.environ.get(BINARY_ENV) or shutil.which(BINARY)
    if not chosen:
        raise Missing(f"llama.cpp's {BINARY} is not on PATH; {HOW_TO_GET}")
    found = Path(chosen)
    if found.is_dir():
        found = found / BINARY
    if not (found.is_file() and os.access(found, os.X_OK)):
        raise Missing(f"{chosen} is not an executable {BINARY}; {HOW_TO_GET}")
    return found


def version(binary: Path) -> str:
    """llama.cpp's build ("version: 1 (0c1e570)"), as ``--version`` prints it."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.startswith("version:")]
    return lines[0].removeprefix("version:").strip() if lines else "unknown"


@dataclass(frozen=True)
class Offload:
    """Where a run puts the model: llama.cpp's flags, and the GPU bytes this plan expects."""

    gpu_layers: int  # -ngl; above the layer count, the output layer is on the GPU too
    cpu_moe_layers: int  # --n-cpu-moe: layers whose experts stay on the CPU
    context: int  # -c: every sequence's prompt and generation, each padded as llama.cpp pads it
    gpu_bytes: int

    def flags(self) -> list[str]:
        out = ["-ngl", str(self.gpu_layers), "-c", str(self.context)]
        return out + (["--n-cpu-moe", str(self.cpu_moe_layers)] if self.cpu_moe_layers else [])


def _layer_bytes(layout: list[Tensor], index: int) -> tuple[int, int]:
    """(bytes of layer ``index`` but its experts, bytes of its experts)."""
    prefix = f"blk.{index}."
    mine = [t for t in layout if t.name.startswith(prefix)]
    experts = sum(stored_bytes(t) for t in mine if "_exps." in t.name)
    return sum(stored_bytes(t) for t in mine) - experts, experts


def compute_reserve(cfg: ModelConfig, ubatch: int = UBATCH) -> int:
    """GPU bytes a run needs beyond weights and cache: COMPUTE_RESERVE and, per token of a micro-batch, f32
    activations of a few hidden-wide vectors and the MLP's gate, up and product (its routed experts' for MoE)."""
    mlp = cfg.experts_per_token * cfg.expert_intermediate_size if cfg.num_experts else cfg.intermediate_size
    return COMPUTE_RESERVE + ubatch * 4 * (4 * cfg.hidden_size + 3 * mlp)


def plan_offload(cfg: ModelConfig, cap: int, batch: int, prompt_len: int, gen_len: int,
                 reserve: int | None = None) -> Offload | None:
    """The most of ``cfg`` on the GPU within ``cap`` bytes for ``batch`` sequences, beside ``reserve`` bytes
    (default: compute_reserve), or None if not even the cache and the compute buffer fit (dense models: no layer
    at all)."""
    reserve = compute_reserve(cfg) if reserve is None else reserve
    layout = tensors(cfg)
    # llama.cpp pads each sequence's cache to CONTEXT_PAD cells (its own KV stream per sequence).
    context = batch * -(-(prompt_len + gen_len) // CONTEXT_PAD) * CONTEXT_PAD
    kv = 2 * cfg.num_kv_heads * cfg.head_dim * KV_BYTES * context  # one layer's keys and values
    output = sum(stored_bytes(t) for t in layout if t.name.startswith("output"))
    layers = [_layer_bytes(layout, i) for i in range(cfg.num_layers)]
    budget = cap - reserve
    if cfg.num_experts:
        # All layers and their caches on the GPU, the output layer too; experts move to the CPU from the first
        # layer on until the rest fits.
        used = output + sum(dense + experts + kv for dense, experts in layers)
        for on_cpu in range(cfg.num_layers + 1):
            if used <= budget:
                return Offload(cfg.num_layers + 1, on_cpu, context, used + reserve)
            if on_cpu < cfg.num_layers:
                used -= layers[on_cpu][1]
        return None
    used, count = 0, 0
    for dense, _ in reversed(layers):  # -ngl offloads the last layers first
        if used + dense + kv > budget:
            break
        used, count = used + dense + kv, count + 1
    if count == cfg.num_layers and used + output <= budget:
        return Offload(count + 1, 0, context, used + output + reserve)
    return Offload(count, 0, context, used + reserve) if count else None


def trailed(batch: int) -> str:
    """-npl: the batch, then one sequence. llama.cpp's logger runs on a thread that is not flushed at exit, and
    lost the last result line in 5 of 30 runs here; a short run after the measured one gives it time to write."""
    return str(batch) if batch == 1 else f"{batch},1"


def command(binary: Path, gguf: Path, offload: Offload, batch: int, prompt_len: int, gen_len: int,
            threads: int | None = None, ubatch: int = UBATCH) -> list[str]:
    # -lm none: no memory map, so that the weights left on the CPU sit in pinned host buffers, which the GPU
    # reads at full PCIe speed (llama.cpp itself advises it where tensors are kept on the CPU).
    size = str(ubatch)
    argv = [str(binary), "-m", str(gguf), *offload.flags(), "-b", size, "-ub", size, "-fa", "on", "-lm", "none",
            "-npp", str(prompt_len), "-ntg", str(gen_len - 1), "-npl", trailed(batch), "--output-format", "jsonl"]
    return argv + (["-t", str(threads)] if threads else [])


def process_gpu_bytes(query_output: str, pid: int) -> int:
    """GPU bytes of process ``pid`` in GPU_QUERY's output (lines "pid, MiB", one per process and GPU)."""
    total = 0
    for line in query_output.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid) and parts[1].isdigit():
            total += int(parts[1]) * MiB
    return total


class GPUSampler:
    """The most GPU memory a process held, polled through nvidia-smi; 0 throughout where there is none."""

    def __init__(self):
        self.tool, self.peak = shutil.which(GPU_QUERY[0]), 0

    def __call__(self, pid: int) -> None:
        if self.tool:
            done = subprocess.run([self.tool, *GPU_QUERY[1:]], capture_output=True, text=True, timeout=30,
                                  check=False)
            self.peak = max(self.peak, process_gpu_bytes(done.stdout, pid))


def parse_result(output: str, prompt_len: int, gen_len: int, batch: int) -> dict | None:
    """prefill / decode / total token/s of the run's JSONL line for ``batch`` sequences, as FlexGen counts them;
    None if it printed none."""
    rows = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            rows.append(json.loads(line))
    rows = [row for row in rows if row["pl"] == batch]
    if not rows:
        return None
    row = rows[-1]
    if row["pp"] != prompt_len or row["tg"] != gen_len - 1:
        raise ValueError(f"llama-batched-bench ran {row['pp']}+{row['tg']}, not {prompt_len}+{gen_len - 1}")
    return {"prefill": batch * prompt_len / row["t_pp"],
            "decode": batch * (gen_len - 1) / row["t_tg"] if row["t_tg"] else 0.0,
            "total": batch * gen_len / row["t"], "batch": batch, "gpu_layers": row["n_gpu_layers"],
            "threads": row["n_threads"], "flash_attn": row["flash_attn"]}
