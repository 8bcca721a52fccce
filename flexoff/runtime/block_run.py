"""One block's generation in flight: its GPU batches, their samplers and stop conditions, what a
head step does with the logits, and the block's metrics once it ends."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..models import architecture
from .batch import GpuBatch, Sequence
from .metrics import Metrics
from .sampler import BatchSampler, prompt_ranked
from .stopping import Decode, StopCondition


class BlockRun:
    """Made by the engine for each block it generates; ``run`` takes the block through a range of
    its tokens (all of them, or one at a time in rotation with other blocks)."""

    def __init__(self, engine, seqs: list[Sequence], decode: Decode | None,
                 on_step: Callable[[int], None] | None, on_prefill: Callable[[], None] | None, blocks: int = 1,
                 place: int = 0):
        self.engine = engine
        self.seqs = seqs
        self.arch = architecture(engine.cfg)
        self.max_new = max(s.params.max_new_tokens for s in seqs)
        self.batches = engine.make_batches(seqs, self.max_new, blocks, place)
        self.metrics = Metrics(num_sequences=len(seqs))
        self.stops = {id(seq): StopCondition(seq.params, engine.cfg.eos_token_ids, decode) for seq in seqs}
        self.samplers = {id(batch): BatchSampler(batch.seqs, engine.cfg.eos_token_ids, engine.cfg.vocab_size,
                                                 engine.device) for batch in self.batches}
        self.on_step, self.on_prefill = on_step, on_prefill
        self.failed: list[Sequence] = []
        self.heads = self.received = 0  # head steps run here; batches' tokens taken from the head
        self.interpreter = engine.interpreter(self.batches, self.sample, self.took_tokens)
        self.start, self.prefill_end = time.perf_counter(), None

    @property
    def going(self) -> bool:
        return any(self.interpreter.active)

    def run(self, tokens: range) -> None:
        self.interpreter.run(self.max_new, tokens)

    def sample(self, batch: GpuBatch, weights: dict) -> None:
        """A head step: the batch's next tokens, their log-probabilities, and whether each sequence stops."""
        engine, arch = self.engine, self.arch
        if batch.start == 0:
            self.prompt_logprobs(batch, weights)
        logits = arch.head(engine.cfg, weights, batch.row_hidden(slice(-1, None)))[:, 0]
        # Its last hidden state is spent: held until the next token's embedding, every batch's
        # prefill states would fill the GPU by the block's last head step.
        batch.hidden = None
        choice = self.samplers[id(batch)].choose(logits, [not s.finished for s in batch.seqs])
        top = choice.top or [None] * len(batch.seqs)
        produced = 0
        for seq, token, logprob, ok, alternatives in zip(batch.seqs, choice.tokens, choice.logprobs,
                                                         choice.finite, top):
            if seq.finished:
                continue
            if not ok:  # its rows are its own: the batch's other sequences go on unaffected
                produced -= len(seq.token_ids)  # its tokens are dropped: take them back from the count
                seq.fail(f"the logits turned non-finite at generated token {len(seq.token_ids) + 1}")
                self.failed.append(seq)
                continue
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            if alternatives is not None:
                seq.top_logprobs.append(alternatives)
            produced += 1
            seq.finish_reason = self.stops[id(seq)].add(token)
            seq.stop_reason = self.stops[id(seq)].reason
        self.metrics.padded_generated_tokens += len(batch.seqs)
        batch.active = not all(s.finished for s in batch.seqs)
        self.heads += 1
        if self.heads == len(self.batches):  # the last batch's prefill just finished
            self.prefill_end = time.perf_counter()
            engine.memory.sample()
        self._progress(produced, self.heads)

    def took_tokens(self, came: int) -> None:
        """A pipeline's first device took a batch's new tokens from the last: progress moves as
        it would at the head."""
        self.received += 1
        self._progress(came, self.received)

    def _progress(self, tokens: int, steps: int) -> None:
        """A batch's step gave ``tokens``; ``steps`` such steps so far, so the prefill is done once
        every batch has had one."""
        if self.on_step:
            self.on_step(tokens)
        if self.on_prefill and steps == len(self.batches):
            self.on_prefill()

    def prompt_logprobs(self, batch: GpuBatch, weights: dict) -> None:
        """vLLM's prompt logprobs of the rows asking, from the prefill's hidden states: one row, and
        a bounded span of positions, at a time, so that (positions, vocab) logits stay small."""
        span, arch = self.engine.logprob_positions, self.arch
        for row, seq in enumerate(batch.seqs):
            k = seq.params.prompt_logprobs
            if k is None:
                continue
            length = len(seq.prompt_ids)
            # Positions predicting prompt tokens 1.., in the prefill's row of this row's prompt.
            hidden = batch.hidden[batch.prefill_row(row)][None, batch.prompt_len - length:-1]
            entries = [None]
            for start in range(0, length - 1, span):
                logits = arch.head(self.engine.cfg, weights, hidden[:, start:start + span])[0].float()
                span_ids = seq.prompt_ids[start:start + span + 1]
                entries += prompt_ranked(torch.log_softmax(logits, dim=-1), span_ids, k)[1:]
            seq.prompt_logprobs = entries

    def finish(self, end: float) -> Metrics:
        """The block's results in its sequences (on a pipeline's first device, from its last) and
        its metrics."""
        engine, metrics, seqs, batches = self.engine, self.metrics, self.seqs, self.batches
        link = engine.link
        self.prefill_end = self.prefill_end or end  # no head step ran here (a pipeline's devices before the last)
        metrics.prefill_time = self.prefill_end - self.start
        metrics.decode_time = end - self.prefill_end
        if link is not None and not (link.place.first and link.place.last):
            timing = ("prefill_time", "decode_time", "padded_generated_tokens")
            if link.place.last:
                link.send_results(seqs, {name: getattr(metrics, name) for name in timing})
            elif link.place.first:  # the block's phases as the head saw them
                for name, value in link.recv_results(seqs).items():
                    setattr(metrics, name, value)
        # GPU bytes of new keys and values kept for the store stream's copies to host rows, at most.
        engine.memory.extra["gpu_store_stream_peak"] = batches[0].kv.stores.peak
        # Prompt tokens the prefill computed: rows sharing a prompt in a GPU batch count it once.
        metrics.prompt_tokens = sum(b.prefill_tokens for b in batches)
        metrics.padded_prompt_tokens = sum(b.prompt_len * b.prefill_rows for b in batches)
        metrics.generated_tokens = sum(len(s.token_ids) for s in seqs)
        metrics.peak_memory = engine.peak_memory()
        for seq in self.failed:  # outside the timed span: the scan reads every weight
            seq.error = f"{seq.error}: {engine.non_finite_cause()}"
        # The interpreter holds this run's head step: a cycle that would keep the block's cache
        # (tens of GiB of pinned host memory) alive until a garbage collection, beside the next block's.
        self.interpreter = None
        return metrics
