"""Time of one head step's token choice for a whole GPU batch (``BatchSampler.choose``), per batch
size, vocabulary and sampling setting, against choosing row by row on the host as flexoff did
before (a copy of the logits to the CPU, then one multinomial draw per row). On CUDA it also
reports the device memory ``choose`` takes at its peak beyond the logits it is given, and the
sampler's state kept for the block, in bytes per (row, vocabulary entry): the figures
flexoff.layout.sampler_bytes counts.

    python bench/sampler_step.py                      # on CUDA if present, else the CPU
    python bench/sampler_step.py --rows 8 32 128 --vocab 50272 128256 --repeats 50

Name the card with the figures you record.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from flexoff import SamplingParams
from flexoff.runtime.sampler import BatchSampler

SETTINGS = {
    "greedy": SamplingParams(),
    "greedy + penalties": SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3),
    "sampled (temperature, top-k, top-p)": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    "sampled + penalties + min-p + logprobs=5": SamplingParams(
        temperature=0.8, top_p=0.95, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=0.3, logprobs=5, min_tokens=4),
}


def per_row_on_host(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> list[int]:
    """The former way: every row's logits on the CPU, then temperature, top-k, top-p and one draw per row."""
    cpu = logits.float().cpu()
    tokens = []
    for row, generator in zip(cpu, generators):
        scaled = row / params.temperature
        if params.top_k:
            scaled = scaled.masked_fill(scaled < torch.topk(scaled, params.top_k).values[-1], -torch.inf)
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            sorted_probs[(torch.cumsum(sorted_probs, 0) - sorted_probs) >= params.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens


def timed(step, device: torch.device, repeats: int) -> float:
    """Median seconds of ``step()``, the device drained around each."""
    times = []
    for _ in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times[2:])[len(times[2:]) // 2]


def peak_bytes(step, device: torch.device) -> int:
    """Device bytes ``step()`` allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--vocab", type=int, nargs="+", default=[50272, 128256])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}")
    print(f"{'rows':>5} {'vocab':>7}  {'setting':<42} {'batched ms':>10} {'per row ms':>10} "
          f"{'peak B/entry':>12} {'state B/entry':>13}")
    for vocab in args.vocab:
        for rows in args.rows:
            logits = torch.randn(rows, vocab, device=device, dtype=torch.float16) * 3
            for label, params in SETTINGS.items():
                seqs = [SimpleNamespace(params=params, seed=i, prompt_ids=list(range(i, i + 512)))
                        for i in range(rows)]
                before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                sampler = BatchSampler(seqs, [2], vocab, device)
                state = (torch.cuda.memory_allocated(device) - before) if device.type == "cuda" else None
                live = [True] * rows
                batched = timed(lambda: sampler.choose(logits, live), device, args.repeats)
                old = "-"
                if not params.greedy and params.min_p == 0 and params.repetition_penalty == 1:
                    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
                    old = f"{1e3 * timed(lambda: per_row_on_host(logits, params, generators), device, args.repeats):10.3f}"
                peak = state_per_entry = "-"
                if device.type == "cuda":  # after the timed steps: the counts hold tokens by now
                    peak = f"{peak_bytes(lambda: sampler.choose(logits, live), device) / (rows * vocab):12.2f}"
                    state_per_entry = f"{state / (rows * vocab):13.2f}"
                print(f"{rows:>5} {vocab:>7}  {label:<42} {1e3 * batched:10.3f} {old:>10} {peak:>12} "
                      f"{state_per_entry:>13}")
                del sampler


if __name__ == "__main__":
    main()
