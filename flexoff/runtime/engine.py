"""The engine: runs blocks of sequences stage by stage, reusing each stage's weights for every GPU
batch of the block (FlexGen's zig-zag order), and turns logits into tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..models import ModelConfig, architecture, stage_names
from ..models.common import attention, attention_mask
from .metrics import MemoryMeter, Metrics
from .policy import Policy
from .sampling import SamplingParams, SequenceSampler, choose_tokens


@dataclass
class Sequence:
    """One prompt in flight: its inputs, what it has produced, and why it stopped."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    sampler: SequenceSampler
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# Decides after each token whether a sequence has hit a stop string; returns True to stop.
StopCheck = Callable[[Sequence], bool]


class DeviceKV:
    """Keys and values of one GPU batch for every layer, preallocated on the compute device.

    Each layer's cache is (batch, kv_heads, slots, head_dim); a step writes its tokens at
    [start, start + seq) and attends over [0, start + seq).
    """

    def __init__(self, cfg: ModelConfig, batch: int, slots: int, device: torch.device, dtype: torch.dtype):
        shape = (batch, cfg.num_kv_heads, slots, cfg.head_dim)
        self.keys = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.values = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]

    def attender(self, layer: int, start: int, mask: torch.Tensor):
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            end = start + k.shape[2]
            self.keys[layer][:, :, start:end] = k
            self.values[layer][:, :, start:end] = v
            return attention(q, self.keys[layer][:, :, :end], self.values[layer][:, :, :end], mask)

        return attend


class GpuBatch:
    """One GPU batch of a block: left-padded inputs, cache and the per-step activations."""

    def __init__(self, cfg: ModelConfig, seqs: list[Sequence], device: torch.device, dtype: torch.dtype,
                 extra_slots: int):
        self.cfg = cfg
        self.seqs = seqs
        self.device = device
        self.dtype = dtype
        self.prompt_len = max(len(s.prompt_ids) for s in seqs)
        self.slots = self.prompt_len + extra_slots
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        rows = [[pad] * (self.prompt_len - len(s.prompt_ids)) + s.prompt_ids for s in seqs]
        self.prompt_ids = torch.tensor(rows, device=device)  # (batch, prompt_len)
        self.lengths = torch.tensor([len(s.prompt_ids) for s in seqs], device=device)
        slot = torch.arange(self.slots, device=device)
        # (batch, slots): False on left padding; every generated slot is real.
        self.valid = slot[None, :] >= (self.prompt_len - self.lengths)[:, None]
        self.kv = DeviceKV(cfg, len(seqs), self.slots, device, dtype)
        self.hidden: torch.Tensor | None = None
        self.active = True

    def begin_step(self, step: int) -> None:
        """Set the step's input ids, positions, slot range and mask (step 0 is the prefill)."""
        if step == 0:
            self.input_ids = self.prompt_ids
            self.start = 0
            self.positions = (torch.cumsum(self.valid[:, :self.prompt_len].long(), dim=1) - 1).clamp(min=0)
        else:
            last = [s.token_ids[-1] for s in self.seqs]
            self.input_ids = torch.tensor(last, device=self.device)[:, None]
            self.start = self.prompt_len + step - 1
            self.positions = (self.lengths + step - 1)[:, None]
        self.mask = attention_mask(self.valid, self.start, self.input_ids.shape[1])
        self.context = architecture(self.cfg).step_context(self.cfg, self.positions, self.dtype)

    def run_stage(self, stage: str, weights: dict) -> None:
        arch = architecture(self.cfg)
        if stage == "embed":
            self.hidden = arch.embed(self.cfg, weights, self.input_ids, self.positions)
        elif stage != "head":
            layer = int(stage.split(".", 1)[1])
            attend = self.kv.attender(layer, self.start, self.mask)
            self.hidden = arch.layer(self.cfg, weights, self.hidden, self.context, attend)


class ResidentWeights:
    """Every stage's weights loaded once onto the compute device (the all-on-device policy)."""

    def __init__(self, cfg: ModelConfig, source, device: torch.device, dtype: torch.dtype):
        from ..models import stage_specs

        self._weights = {
            stage: source.load_stage(stage, stage_specs(cfg, stage), device, dtype) for stage in stage_names(cfg)
        }

    def get(self, stage: str) -> dict:
        return self._weights[stage]

    def close(self) -> None:
        self._weights.clear()


class Engine:
    def __init__(self, cfg: ModelConfig, source, policy: Policy, device: torch.device, dtype: torch.dtype,
                 seed: int = 0):
        self.cfg = cfg
        self.policy = policy
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.stages = stage_names(cfg)
        self.memory = MemoryMeter(device)
        self.weights = ResidentWeights(cfg, source, device, dtype)

    def close(self) -> None:
        self.weights.close()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _split(self, seqs: list, extra_slots: int) -> list[GpuBatch]:
        size = self.policy.gpu_batch_size
        return [GpuBatch(self.cfg, seqs[i:i + size], self.device, self.dtype, extra_slots)
                for i in range(0, len(seqs), size)]

    def _run_step(self, batches: list[GpuBatch], step: int,
                  on_head: Callable[[GpuBatch, dict], None]) -> None:
        """One token step of the zig-zag order: each stage's weights serve every batch in turn."""
        active = [b for b in batches if b.active]
        for batch in active:
            batch.begin_step(step)
        for stage in self.stages:
            weights = self.weights.get(stage)
            for batch in active:
                batch.run_stage(stage, weights)
                if stage == "head":
                    on_head(batch, weights)

    def generate_block(self, seqs: list[Sequence], stop_check: StopCheck | None = None,
                       on_step: Callable[[int], None] | None = None) -> Metrics:
        """Generate for every sequence of one block; fills each Sequence in place.

        ``on_step`` receives the number of tokens each step produced, for progress bars.
        """
        arch = architecture(self.cfg)
        max_new = max(s.params.max_new_tokens for s in seqs)
        batches = self._split(seqs, max_new)
        metrics = Metrics(num_sequences=len(seqs))
        eos = set(self.cfg.eos_token_ids)
        produced = [0]  # tokens appended in the current step, for progress reports

        def sample(batch: GpuBatch, weights: dict) -> None:
            logits = arch.head(self.cfg, weights, batch.hidden[:, -1:])[:, 0]
            tokens, logprobs = choose_tokens([s.sampler for s in batch.seqs], logits)
            for seq, token, logprob in zip(batch.seqs, tokens, logprobs):
                if seq.finished:
                    continue
                seq.token_ids.append(token)
                seq.logprobs.append(logprob)
                produced[0] += 1
                if token in eos and not seq.params.ignore_eos:
                    seq.finish_reason = "stop"
                elif stop_check is not None and seq.params.stop and stop_check(seq):
                    seq.finish_reason = "stop"
                elif len(seq.token_ids) >= seq.params.max_new_tokens:
                    seq.finish_reason = "length"
            metrics.padded_generated_tokens += len(batch.seqs)
            batch.active = not all(s.finished for s in batch.seqs)

        def run(step: int) -> None:
            produced[0] = 0
            self._run_step(batches, step, sample)
            if on_step:
                on_step(produced[0])

        self.memory.reset()
        started = time.perf_counter()
        run(0)
        self._sync()
        metrics.prefill_time = time.perf_counter() - started
        self.memory.sample()
        started = time.perf_counter()
        for step in range(1, max_new):
            if not any(b.active for b in batches):
                break
            run(step)
        self._sync()
        metrics.decode_time = time.perf_counter() - started
        metrics.prompt_tokens = sum(len(s.prompt_ids) for s in seqs)
        metrics.padded_prompt_tokens = sum(b.prompt_len * len(b.seqs) for b in batches)
        metrics.generated_tokens = sum(len(s.token_ids) for s in seqs)
        metrics.peak_memory = self.memory.peaks()
        return metrics

    def _prefill_only(self, token_lists: list[list[int]], on_head: Callable[[GpuBatch, dict], None]) -> None:
        greedy = SamplingParams(max_new_tokens=1)
        seqs = [Sequence(i, ids, greedy, SequenceSampler(greedy, self.seed)) for i, ids in enumerate(token_lists)]
        self._run_step(self._split(seqs, 0), 0, on_head)

    def last_logits(self, token_lists: list[list[int]]) -> torch.Tensor:
        """Logits after the last token of each list: (len(token_lists), vocab), fp32 on the CPU."""
        arch = architecture(self.cfg)
        out = torch.empty(len(token_lists), self.cfg.vocab_size)

        def keep(batch: GpuBatch, weights: dict) -> None:
            logits = arch.head(self.cfg, weights, batch.hidden[:, -1:])[:, 0].float().cpu()
            for row, seq in enumerate(batch.seqs):
                out[seq.index] = logits[row]

        self._prefill_only(token_lists, keep)
        return out

    def score_block(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
        """Log-probability of each continuation token given its prompt, from one prefill pass."""
        arch = architecture(self.cfg)
        results: list[list[float]] = [[] for _ in prompts]
        lengths = [len(c) for c in continuations]

        def score(batch: GpuBatch, weights: dict) -> None:
            span = max(lengths[s.index] for s in batch.seqs)
            # Logits at slot j predict the token at slot j + 1; continuations end at the right edge.
            logits = arch.head(self.cfg, weights, batch.hidden[:, -span - 1:-1]).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            targets = batch.prompt_ids[:, -span:]
            picked = logprobs.gather(2, targets[..., None])[..., 0].cpu()
            for row, seq in enumerate(batch.seqs):
                n = lengths[seq.index]
                results[seq.index] = picked[row, span - n:].tolist()

        self._prefill_only([p + c for p, c in zip(prompts, continuations)], score)
        return results
