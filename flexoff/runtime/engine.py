"""The engine: places the model on its tiers, then runs blocks of sequences: it forms a block's GPU
batches and has the block schedule (schedule.py) run over them (interpreter.py); sampling, scoring
and stopping happen as each head step's event comes back (block_run.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from ..errors import PolicyError
from ..models import ModelConfig, architecture, stages
from ..weights import WeightSource
from .activations import BatchActivations
from .batch import GpuBatch, Sequence, arrange, span_lengths
from .block_run import BlockContext, BlockRun
from .decode_graphs import DecodeGraphs
from .interpreter import BlockInterpreter, HeadReady, Observer
from .kv import BatchKV, BlockKV, KVWorkspace
from ..layout import (Capacity, check_fits, job_bytes, keeps_cache, logprob_positions, owned_layers, pins_host_memory,
                      weight_bytes)
from .memory import configure_cuda_allocators
from .metrics import MemoryMeter, Metrics
from .offload_dir import remove_dead_folders
from .pipeline import PipelineLink
from .prefix_kv import PrefixKV
from ..policy import Policy
from .sampler import BatchSampler
from .sampling import SamplingParams
from .stopping import Decode, StopCondition
from .tiers import DiskTier, HostMemory, HostWorker, Streams
from .weight_store import TieredWeights

HeadHook = Callable[[GpuBatch, Mapping[str, torch.Tensor]], None]  # scores a batch from the head's weights


def held_bytes(weights: TieredWeights, disk: DiskTier | None) -> dict[str, int]:
    """Bytes flexoff holds outside the allocator's and the resident set's counts: the host's
    weights, and what is reserved on disk."""
    held = {"cpu_weights": weights.bytes["cpu"]}
    if disk is not None:
        held["disk"] = disk.bytes_reserved
    return held


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
                 link: PipelineLink | None = None, share_prefixes: bool = True, cuda_graphs: bool = True):
        """``link``: this device is one stage of a pipeline, running its range of the model's
        stages (``link.place``); it holds only their weights and caches. ``share_prefixes``: a GPU
        batch whose rows begin alike runs that prefix once (``flexoff.prefixes``). ``cuda_graphs``:
        decode layers run from CUDA graphs where they can (``decode_graphs``)."""
        self.cfg = cfg
        self.policy = policy
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.capacity = capacity or Capacity(None, None, None)
        self.stages = stages(cfg)
        self.link = link
        self.share_prefixes = share_prefixes
        self.graphs = DecodeGraphs(device, cuda_graphs, self.capacity.gpu)
        self.owned = link.place.owned if link is not None else None
        configure_cuda_allocators(device)
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
            self.disk = DiskTier(offload_dir)  # which removes dead owners' folders first
        elif offload_dir is not None:
            # Also when this run puts nothing on disk: a killed disk run's folder may be gigabytes.
            remove_dead_folders(Path(offload_dir))
        try:
            self.weights = TieredWeights(cfg, source, policy, device, dtype, self.streams, self.disk, self.owned)
        except BaseException:
            self.close()
            raise
        self.memory = MemoryMeter(device, partial(held_bytes, self.weights, self.disk))
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
        self.graphs.close()
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

    def make_batches(self, seqs: list[Sequence], extra_slots: int, blocks: int = 1, block: int = 0) -> list[GpuBatch]:
        """The block's GPU batches, once the memory of ``blocks`` such blocks (those in rotation) fits;
        ``block``: its place in the rotation, which names its batches' offload files apart."""
        policy = self.policy
        size = policy.gpu_batch_size
        prompt_len = max(len(s.prompt_ids) for s in seqs)
        what = f"a block of {len(seqs)} sequences of up to {prompt_len}+{extra_slots} tokens"
        groups = [seqs[start:start + size] for start in range(0, len(seqs), size)]
        # Sharing is one batch's business; a pipeline's stages pass one hidden state a batch.
        shares = self.share_prefixes and self.link is None
        arranged = [arrange(group) if shares else (group, []) for group in groups]
        longest = max((length for _, spans in arranged for _, _, length in spans), default=0)
        most = max((len(spans) for _, spans in arranged), default=0)
        # The layout counts each batch as the longest rows of their own beside the most prefix rows
        # of the longest prefix.
        own_len = max(len(q.prompt_ids) - n for group, spans in arranged
                      for q, n in zip(group, span_lengths(len(group), spans)))
        check_fits(job_bytes(self.cfg, policy, self.dtype, own_len + longest, extra_slots, self.pins_host, self.owned,
                             blocks, prefix_len=longest, prefix_rows=max(most, 1)),
                   self.capacity, what if blocks == 1 else f"{blocks} blocks in rotation, each {what[2:]}")
        keeps = keeps_cache(extra_slots)
        workspace = KVWorkspace.for_block(self.cfg, policy, min(size, len(seqs)), own_len + extra_slots,
                                          self.device, self.dtype, self.streams) if keeps else None
        host = HostMemory(policy.pin_cpu_memory)  # freed with the block
        layers = None if self.owned is None else tuple(owned_layers(self.cfg, self.owned))
        shared = BlockKV(self.cfg, policy, self.device, self.dtype, self.streams, host, self.disk, self.worker,
                         workspace, layers=layers)
        # The prefixes (a row each) travel through a workspace of their own, sized for the most and longest.
        prefix_workspace = KVWorkspace.for_block(self.cfg, policy, most, longest, self.device, self.dtype,
                                                 self.streams) if longest and keeps else None
        prefix_block = replace(shared, workspace=prefix_workspace) if longest else None
        batches = []
        for number, (group, spans) in enumerate(arranged):
            name = f"b{number}" if block == 0 else f"r{block}.b{number}"

            def make_kv(count, slots, merges, name=name):
                return BatchKV(shared, count, slots, name, merges, keeps)

            def make_activations(count, length, name=name):
                return BatchActivations(count, length * self.cfg.hidden_size, policy.activations, self.device,
                                        self.dtype, host, self.disk, name)

            def make_prefix(rows, length, name=f"{name}.prefix"):  # their cache and hidden state, a row each
                return PrefixKV(prefix_block, rows, length, name, keeps=keeps), make_activations(rows, length, name)

            batches.append(GpuBatch(self.cfg, group, self.device, self.dtype, extra_slots, make_kv, make_activations,
                                    spans, make_prefix))
        return batches

    def interpreter(self, batches: list[GpuBatch]) -> BlockInterpreter:
        return BlockInterpreter(batches, self.stages, self.weights, self.worker, self.observer, self.link, self.graphs)

    def _block_run(self, seqs: list[Sequence], decode: Decode | None, context: BlockContext, blocks: int, place: int,
                   on_step: Callable[[int], None] | None, on_prefill: Callable[[], None] | None) -> BlockRun:
        """Block ``place`` of ``blocks`` in rotation, with its batches, samplers, stop conditions
        and interpreter."""
        batches = self.make_batches(seqs, max(s.params.max_new_tokens for s in seqs), blocks, place)
        eos, vocab = self.cfg.eos_token_ids, self.cfg.vocab_size
        samplers = [BatchSampler(batch.seqs, eos, vocab, self.device) for batch in batches]
        stops = {id(seq): StopCondition(seq.params, eos, decode) for seq in seqs}
        return BlockRun(seqs, self.interpreter(batches), samplers, stops, context, on_step, on_prefill)

    def generate_block(self, seqs: list[Sequence], decode: Decode | None = None,
                       on_step: Callable[[int], None] | None = None,
                       on_prefill: Callable[[], None] | None = None) -> Metrics:
        """Generate for every sequence of one block; fills each Sequence in place.

        ``decode`` (token ids to text) lets stop strings be matched; without it they are not.

        ``on_step`` receives the number of tokens each batch's step produced, and ``on_prefill`` is
        called once the block's prefill is done (after that step's ``on_step``), for progress bars.
        """
        return self.generate_blocks([seqs], decode, on_step, on_prefill)[0]

    def generate_blocks(self, blocks: list[list[Sequence]], decode: Decode | None = None,
                        on_step: Callable[[int], None] | None = None,
                        on_prefill: Callable[[], None] | None = None) -> list[Metrics]:
        """Generate several blocks in rotation: each token of each block in turn, so that in a
        pipeline of as many devices as blocks, every device works on one of them at a time (each
        device runs one block's token over its stages while its neighbours run the others').
        One block runs its tokens one after another."""
        self.memory.reset()
        context = BlockContext(self.cfg, self.logprob_positions, self.memory, self.non_finite_cause, self.link)
        runs = [self._block_run(seqs, decode, context, len(blocks), n, on_step, on_prefill)
                for n, seqs in enumerate(blocks)]
        self.weights.begin_block(max(len(b.seqs) for run in runs for b in run.batches),
                                 max(len(run.batches) for run in runs))
        if len(runs) == 1:  # one schedule for all its tokens: a token's first stage loads during the last
            runs[0].run(range(runs[0].max_new))
        else:
            for token in range(max(run.max_new for run in runs)):
                for run in runs:
                    if token < run.max_new and run.going:
                        run.run(range(token, token + 1))
        self._sync()
        end = time.perf_counter()
        if self.link is not None:
            self.link.flush()
        return [run.finish(end) for run in runs]

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
        return self.memory.peaks()

    def _prefill_only(self, token_lists: list[list[int]], on_head: HeadHook, keep: list[int] | None = None) -> None:
        """One prefill of the token lists, ``on_head`` taking each batch at its head step (which reads
        ``keep[i]`` of list i's last positions, default 1)."""
        greedy = SamplingParams(max_new_tokens=1)
        seqs = [Sequence(i, ids, greedy, self.seed, keep=keep[i] if keep else 1) for i, ids in enumerate(token_lists)]
        batches = self.make_batches(seqs, 0)
        with closing(self.interpreter(batches).run(1)) as events:
            for event in events:
                if isinstance(event, HeadReady):
                    on_head(batches[event.batch], event.weights)
        if self.link is not None:  # a pipeline's head steps ran on its last device only
            self.link.flush()

    def last_logits(self, token_lists: list[list[int]]) -> torch.Tensor:
        """Logits after the last token of each list: (len(token_lists), vocab), fp32 on the CPU."""
        arch = architecture(self.cfg)
        out = torch.empty(len(token_lists), self.cfg.vocab_size)

        def keep(batch: GpuBatch, weights: Mapping[str, torch.Tensor]) -> None:
            logits = arch.head(self.cfg, weights, batch.row_hidden(slice(-1, None)))[:, 0].float().cpu()
            for row, seq in enumerate(batch.seqs):
                out[seq.index] = logits[row]

        self._prefill_only(token_lists, keep)
        return out

    def score_block(self, prompts: list[list[int]],
                    continuations: list[list[int]]) -> list[tuple[list[float], bool]]:
        """Log-probability of each continuation token given its prompt, and whether every one of
        them is its position's most likely token, from one prefill pass."""
        arch = architecture(self.cfg)
        results: list[tuple[list[float], bool]] = [([], True) for _ in prompts]
        lengths = [len(c) for c in continuations]

        def score(batch: GpuBatch, weights: Mapping[str, torch.Tensor]) -> None:
            span = max(lengths[s.index] for s in batch.seqs)
            # Logits at slot j predict the token at slot j + 1; continuations end at the right edge.
            hidden = batch.row_hidden(slice(-span - 1, -1))
            targets = batch.prompt_ids[:, -span:]
            picked = torch.empty(targets.shape)
            # Teacher-forced argmax: greedy decoding generates the continuation exactly when every
            # token is its position's most likely, so no generation pass is needed to tell.
            most_likely = torch.empty(targets.shape, dtype=torch.bool)
            for rows, positions in logprob_chunks(len(batch.seqs), span, self.logprob_positions):
                logits = arch.head(self.cfg, weights, hidden[rows, positions]).float()
                logprobs = torch.log_softmax(logits, dim=-1)
                chosen = targets[rows, positions]
                picked[rows, positions] = logprobs.gather(2, chosen[..., None])[..., 0].cpu()
                most_likely[rows, positions] = (logits.argmax(dim=-1) == chosen).cpu()
            for row, seq in enumerate(batch.seqs):
                n = lengths[seq.index]
                results[seq.index] = (picked[row, span - n:].tolist(), bool(most_likely[row, span - n:].all()))

        self._prefill_only([p + c for p, c in zip(prompts, continuations)], score, [n + 1 for n in lengths])
        return results
