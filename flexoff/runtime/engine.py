"""The engine: places the model on its tiers, then runs blocks of sequences: it forms a block's GPU
batches and has the block schedule (schedule.py) run over them (interpreter.py); sampling, scoring
and stopping happen at each HEAD step."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..errors import PolicyError
from ..models import ModelConfig, architecture, stages
from ..weights import WeightSource
from .activations import BatchActivations
from .batch import GpuBatch, Sequence
from .interpreter import BlockInterpreter, HeadHook, Observer
from .kv import BatchKV, BlockKV, KVWorkspace
from ..layout import Capacity, cache_layers, check_fits, job_bytes, logprob_positions, pins_host_memory, weight_bytes
from .memory import grow_segments_in_place
from .metrics import MemoryMeter, Metrics
from .pipeline import PipelineLink
from ..policy import Policy
from .sampler import BatchSampler, prompt_ranked
from .sampling import SamplingParams
from .stopping import Decode, StopCondition
from .tiers import DiskTier, HostMemory, HostWorker, Streams
from .weight_store import TieredWeights


def logprob_chunks(rows: int, positions: int, per_chunk: int):
    """(rows, positions) slices covering a (rows, positions) grid once, each of at most ``per_chunk``
    positions in all: whole rows together where a row fits, else a row cut into spans."""
    if positions <= per_chunk:
        group = per_chunk // positions
        for start in range(0, rows, group):
            yield slice(start, min(start + group, rows)), slice(0, positions)
        return
    for row in range(rows):
        for start in range(0, positions, per_chunk):
            yield slice(row, row + 1), slice(start, min(start + per_chunk, positions))


class Engine:
    def __init__(self, cfg: ModelConfig, source: WeightSource, policy: Policy, device: torch.device, dtype: torch.dtype,
                 seed: int = 0, offload_dir: str | None = None, capacity: Capacity | None = None,
                 link: PipelineLink | None = None):
        """``link``: this device is one stage of a pipeline, running its range of the model's
        stages (``link.place``); it holds only their weights and caches."""
        self.cfg = cfg
        self.policy = policy
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.capacity = capacity or Capacity(None, None, None)
        self.stages = stages(cfg)
        self.link = link
        self.owned = link.place.owned if link is not None else None
        grow_segments_in_place(device)
        self.memory = MemoryMeter(device)
        self.streams = Streams(device, policy.overlap)
        # Host-side cache work (see kv.py), on one thread for the engine's lifetime.
        self.worker: HostWorker | None = HostWorker(device, self.streams, policy.pin_cpu_memory)
        self.disk: DiskTier | None = None
        self.weights: TieredWeights | None = None
        self.pins_host = pins_host_memory(policy.pin_cpu_memory)
        self._non_finite_cause: str | None = None
        # Prompt logprobs and scores are made a few positions at a time, within the memory a head step is counted for.
        self.logprob_positions = logprob_positions(policy.gpu_batch_size, cfg.vocab_size, dtype.itemsize)
        self.observer: Observer | None = None  # sees every step of the block schedule as it runs
        self._weight_bytes = weight_bytes(cfg, policy, dtype, self.pins_host, self.owned)
        check_fits(self._weight_bytes, self.capacity, "placing the weights")
        if policy.uses_disk:
            if offload_dir is None:
                raise PolicyError("the policy puts data on disk, but no offload directory was given "
                                  "(--offload-dir DIR, or FLEXOFF_OFFLOAD_DIR)")
            self.disk = DiskTier(offload_dir)
        try:
            self.weights = TieredWeights(cfg, source, policy, device, dtype, self.streams, self.disk, self.owned)
        except BaseException:
            self.close()
            raise
        # Requested and realised weight fractions per tier, the worst per-stage deviation, and the
        # bytes of weights stored on each tier.
        self.placement_report = {
            "requested": self.weights.requested(),
            "realised": self.weights.realised(),
            "bytes": dict(self.weights.bytes),
            "max_stage_deviation": self.weights.max_layer_deviation(),
        }

    def close(self) -> None:
        """Free device buffers and pinned memory, and delete every offload file."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self.weights is not None:
            self.weights.close()
            self.weights = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None


    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _make_batches(self, seqs: list[Sequence], extra_slots: int) -> list[GpuBatch]:
        policy = self.policy
        size = policy.gpu_batch_size
        prompt_len = max(len(s.prompt_ids) for s in seqs)
        check_fits(job_bytes(self.cfg, policy, self.dtype, prompt_len, extra_slots, self.pins_host, self.owned),
                   self.capacity,
                   f"a block of {len(seqs)} sequences of up to {prompt_len}+{extra_slots} tokens")
        workspace = KVWorkspace.for_block(self.cfg, policy, min(size, len(seqs)), prompt_len + extra_slots,
                                          self.device, self.dtype, self.streams)
        host = HostMemory(policy.pin_cpu_memory)  # freed with the block
        layers = None if self.owned is None else tuple(cache_layers(self.cfg, self.owned))
        shared = BlockKV(self.cfg, policy, self.device, self.dtype, self.streams, host, self.disk, self.worker,
                         workspace, layers=layers)
        batches = []
        for number, start in enumerate(range(0, len(seqs), size)):
            name = f"b{number}"

            def make_kv(count, slots, name=name):
                return BatchKV(shared, count, slots, name)

            def make_activations(count, length, name=name):
                return BatchActivations(count, length * self.cfg.hidden_size, policy.activations, self.device,
                                        self.dtype, host, self.disk, name)

            batches.append(GpuBatch(self.cfg, seqs[start:start + size], self.device, self.dtype, extra_slots,
                                    make_kv, make_activations))
        return batches

    def _execute(self, batches: list[GpuBatch], num_tokens: int, on_head: HeadHook) -> None:
        """Run the block schedule; it ends early once every batch has finished."""
        BlockInterpreter(batches, self.stages, self.weights, self.worker, on_head, self.observer,
                         self.link).run(num_tokens)

    def generate_block(self, seqs: list[Sequence], decode: Decode | None = None,
                       on_step: Callable[[int], None] | None = None,
                       on_prefill: Callable[[], None] | None = None) -> Metrics:
        """Generate for every sequence of one block; fills each Sequence in place.

        ``decode`` (token ids to text) lets stop strings be matched; without it they are not.

        ``on_step`` receives the number of tokens each batch's step produced, and ``on_prefill`` is
        called once the block's prefill is done (after that step's ``on_step``), for progress bars.
        """
        arch = architecture(self.cfg)
        max_new = max(s.params.max_new_tokens for s in seqs)
        self.memory.reset()
        batches = self._make_batches(seqs, max_new)
        self.weights.begin_block(max(len(batch.seqs) for batch in batches), len(batches))
        metrics = Metrics(num_sequences=len(seqs))
        stops = {id(seq): StopCondition(seq.params, self.cfg.eos_token_ids, decode) for seq in seqs}
        samplers = {id(batch): BatchSampler(batch.seqs, self.cfg.eos_token_ids, self.cfg.vocab_size, self.device)
                    for batch in batches}
        clock = {"start": time.perf_counter(), "prefill_end": None, "heads": 0}
        failed: list[Sequence] = []

        def sample(batch: GpuBatch, weights: dict) -> None:
            if batch.start == 0:
                self._prompt_logprobs(arch, batch, weights)
            logits = arch.head(self.cfg, weights, batch.row_hidden(slice(-1, None)))[:, 0]
            # Its last hidden state is spent: held until the next token's embedding, every batch's
            # prefill states would fill the GPU by the block's last head step.
            batch.hidden = None
            choice = samplers[id(batch)].choose(logits, [not s.finished for s in batch.seqs])
            top = choice.top or [None] * len(batch.seqs)
            produced = 0
            for seq, token, logprob, ok, alternatives in zip(batch.seqs, choice.tokens, choice.logprobs,
                                                             choice.finite, top):
                if seq.finished:
                    continue
                if not ok:  # its rows are its own: the batch's other sequences go on unaffected
                    produced -= len(seq.token_ids)  # its tokens are dropped: take them back from the count
                    seq.fail(f"the logits turned non-finite at generated token {len(seq.token_ids) + 1}")
                    failed.append(seq)
                    continue
                seq.token_ids.append(token)
                seq.logprobs.append(logprob)
                if alternatives is not None:
                    seq.top_logprobs.append(alternatives)
                produced += 1
                seq.finish_reason = stops[id(seq)].add(token)
                seq.stop_reason = stops[id(seq)].reason
            metrics.padded_generated_tokens += len(batch.seqs)
            batch.active = not all(s.finished for s in batch.seqs)
            clock["heads"] += 1
            if clock["heads"] == len(batches):  # the last batch's prefill just finished
                clock["prefill_end"] = time.perf_counter()
                self.memory.sample()
            if on_step:
                on_step(produced)
            if on_prefill and clock["heads"] == len(batches):
                on_prefill()

        self._execute(batches, max_new, sample)
        self._sync()
        end = time.perf_counter()
        if self.link is not None and not (self.link.place.first and self.link.place.last):
            # The head's device has the results; the embedding's device returns them.
            if self.link.place.last:
                self.link.send_results(seqs)
            elif self.link.place.first:
                self.link.recv_results(seqs)
            clock["prefill_end"] = clock["prefill_end"] or end  # no head step ran here
        # GPU bytes of new keys and values kept for the store stream's copies to host rows, at most.
        self.memory.extra["gpu_store_stream_peak"] = batches[0].kv.stores.peak
        metrics.prefill_time = clock["prefill_end"] - clock["start"]
        metrics.decode_time = end - clock["prefill_end"]
        # Prompt tokens the prefill computed: rows sharing a prompt in a GPU batch count it once.
        metrics.prompt_tokens = sum(b.prefill_tokens for b in batches)
        metrics.padded_prompt_tokens = sum(b.prompt_len * b.prefill_rows for b in batches)
        metrics.generated_tokens = sum(len(s.token_ids) for s in seqs)
        metrics.peak_memory = self.peak_memory()
        for seq in failed:  # outside the timed span: the scan reads every weight
            seq.error = f"{seq.error}: {self.non_finite_cause()}"
        return metrics

    def _prompt_logprobs(self, arch, batch: GpuBatch, weights: dict) -> None:
        """vLLM's prompt logprobs of the rows asking, from the prefill's hidden states: one row, and
        a bounded span of positions, at a time, so that (positions, vocab) logits stay small."""
        span = self.logprob_positions
        for row, seq in enumerate(batch.seqs):
            k = seq.params.prompt_logprobs
            if k is None:
                continue
            length = len(seq.prompt_ids)
            # Positions predicting prompt tokens 1.., in the prefill's row of this row's prompt.
            hidden = batch.hidden[batch.prefill_row(row)][None, batch.prompt_len - length:-1]
            entries = [None]
            for start in range(0, length - 1, span):
                logits = arch.head(self.cfg, weights, hidden[:, start:start + span])[0].float()
                span_ids = seq.prompt_ids[start:start + span + 1]
                entries += prompt_ranked(torch.log_softmax(logits, dim=-1), span_ids, k)[1:]
            seq.prompt_logprobs = entries

    def non_finite_cause(self) -> str:
        """Why logits turned non-finite, as far as one scan of the placed weights can tell (made
        once, when first asked: the normal path never pays for it)."""
        if self._non_finite_cause is None:
            where = self.weights.first_non_finite()
            if where is not None:
                self._non_finite_cause = f"weight {where} holds NaN or infinite values"
            else:
                hint = "; try dtype bfloat16 or float32" if self.dtype == torch.float16 else ""
                self._non_finite_cause = ("no weight holds a NaN or an infinity: the activations must have "
                                          f"overflowed{hint}")
        return self._non_finite_cause

    def peak_memory(self) -> dict[str, int]:
        """Peak bytes per tier: the GPU allocator's peak, the host bytes flexoff holds for weights
        and the process's resident set, and the bytes reserved on disk."""
        peaks = self.memory.peaks()
        peaks["cpu_weights"] = self.weights.bytes["cpu"]
        if self.disk is not None:
            peaks["disk"] = self.disk.bytes_reserved
        return peaks

    def _prefill_only(self, token_lists: list[list[int]], on_head: HeadHook) -> None:
        greedy = SamplingParams(max_new_tokens=1)
        seqs = [Sequence(i, ids, greedy, self.seed) for i, ids in enumerate(token_lists)]
        self._execute(self._make_batches(seqs, 0), 1, on_head)

    def last_logits(self, token_lists: list[list[int]]) -> torch.Tensor:
        """Logits after the last token of each list: (len(token_lists), vocab), fp32 on the CPU."""
        arch = architecture(self.cfg)
        out = torch.empty(len(token_lists), self.cfg.vocab_size)

        def keep(batch: GpuBatch, weights: dict) -> None:
            logits = arch.head(self.cfg, weights, batch.row_hidden(slice(-1, None)))[:, 0].float().cpu()
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
            hidden = batch.row_hidden(slice(-span - 1, -1))
            targets = batch.prompt_ids[:, -span:]
            picked = torch.empty(targets.shape)
            for rows, positions in logprob_chunks(len(batch.seqs), span, self.logprob_positions):
                logits = arch.head(self.cfg, weights, hidden[rows, positions]).float()
                logprobs = torch.log_softmax(logits, dim=-1)
                picked[rows, positions] = logprobs.gather(2, targets[rows, positions][..., None])[..., 0].cpu()
            for row, seq in enumerate(batch.seqs):
                n = lengths[seq.index]
                results[seq.index] = picked[row, span - n:].tolist()

        self._prefill_only([p + c for p, c in zip(prompts, continuations)], score)
        return results
