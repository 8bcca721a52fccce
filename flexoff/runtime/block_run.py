"""One block's generation in flight: its GPU batches, their samplers and stop conditions, what a
head step does with the logits, and the block's metrics once it ends. It runs the block's
interpreter and acts on the events it hands back."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass

import torch

from ..models import ModelConfig, architecture
from .batch import GpuBatch, Sequence
from .interpreter import BlockInterpreter, HeadReady, TokensTaken
from .metrics import Meter, Metrics
from .pipeline import PipelineLink
from .sampler import BatchSampler, prompt_ranked
from .stopping import StopCondition


@dataclass(frozen=True)
class BlockContext:
    """What every block of a generation shares beyond its own batches."""

    cfg: ModelConfig
    logprob_positions: int  # positions whose prompt logprobs one pass of the head computes
    meter: Meter
    non_finite_cause: Callable[[], str]  # why logits turned non-finite: asked only once they have
    link: PipelineLink | None = None  # a pipeline stage's peers


class BlockRun:
    """One block, its collaborators made by its owner (one sampler per batch, one stop condition
    per sequence, by ``id``); ``run`` takes it through a range of its tokens (all of them, or one
    at a time in rotation with other blocks)."""

    def __init__(self, seqs: list[Sequence], interpreter: BlockInterpreter, samplers: list[BatchSampler],
                 stops: dict[int, StopCondition], context: BlockContext,
                 on_step: Callable[[int], None] | None = None, on_prefill: Callable[[], None] | None = None):
        self.seqs = seqs
        self.batches: list[GpuBatch] = interpreter.batches  # the ones its schedule runs
        self.samplers = samplers
        self.stops = stops
        self.interpreter = interpreter
        self.context = context
        self.arch = architecture(context.cfg)
        self.max_new = max(s.params.max_new_tokens for s in seqs)
        self.metrics = Metrics(num_sequences=len(seqs))
        self.on_step, self.on_prefill = on_step, on_prefill
        self.failed: list[Sequence] = []
        self.heads = self.received = 0  # head steps run here; batches' tokens taken from the head
        self.start, self.prefill_end = time.perf_counter(), None

    @property
    def going(self) -> bool:
        return any(self.interpreter.running)

    def run(self, tokens: range) -> None:
        with closing(self.interpreter.run(self.max_new, tokens)) as events:
            for event in events:
                match event:
                    case HeadReady(batch, weights):
                        self.sample(batch, weights)
                    case TokensTaken(_, count):
                        self.took_tokens(count)
                # A BatchFinished needs nothing here: the schedule reads it from the batch.

    def sample(self, k: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Batch k's head step: its next tokens, their log-probabilities, and whether each sequence stops."""
        batch, cfg = self.batches[k], self.context.cfg
        if batch.start == 0:
            self.prompt_logprobs(batch, weights)
        logits = self.arch.head(cfg, weights, batch.row_hidden(slice(-1, None)))[:, 0]
        # Its last hidden state is spent: held until the next token's embedding, every batch's
        # prefill states would fill the GPU by the block's last head step.
        batch.hidden = None
        choice = self.samplers[k].choose(logits, [not s.finished for s in batch.seqs])
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
        self.heads += 1
        if self.heads == len(self.batches):  # the last batch's prefill just finished
            self.prefill_end = time.perf_counter()
            self.context.meter.sample()
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

    def prompt_logprobs(self, batch: GpuBatch, weights: Mapping[str, torch.Tensor]) -> None:
        """vLLM's prompt logprobs of the rows asking, from the prefill's hidden states: one row, and
        a bounded span of positions, at a time, so that (positions, vocab) logits stay small."""
        span, cfg = self.context.logprob_positions, self.context.cfg
        for row, seq in enumerate(batch.seqs):
            k = seq.params.prompt_logprobs
            if k is None:
                continue
            length = len(seq.prompt_ids)
            # Positions predicting prompt tokens 1.., in the prefill's row of this row's prompt.
            hidden = batch.hidden[batch.prefill_row(row)][None, batch.prompt_len - length:-1]
            entries = [None]
            for start in range(0, length - 1, span):
                logits = self.arch.head(cfg, weights, hidden[:, start:start + span])[0].float()
                span_ids = seq.prompt_ids[start:start + span + 1]
                entries += prompt_ranked(torch.log_softmax(logits, dim=-1), span_ids, k)[1:]
            seq.prompt_logprobs = entries

    def finish(self, end: float) -> Metrics:
        """The block's results in its sequences (on a pipeline's first device, from its last) and
        its metrics."""
        context, metrics, seqs, batches = self.context, self.metrics, self.seqs, self.batches
        self.prefill_end = self.prefill_end or end  # no head step ran here (a pipeline's devices before the last)
        metrics.prefill_time = self.prefill_end - self.start
        metrics.decode_time = end - self.prefill_end
        self._share_results()
        # GPU bytes of new keys and values kept for the store stream's copies to host rows, at most.
        context.meter.extra["gpu_store_stream_peak"] = batches[0].kv.stores.peak
        # Prompt tokens the prefill computed: rows sharing a prompt in a GPU batch count it once.
        metrics.prompt_tokens = sum(b.prefill_tokens for b in batches)
        metrics.padded_prompt_tokens = sum(b.prompt_len * b.prefill_rows for b in batches)
        metrics.padded_prompt_tokens += sum(len(b.prefix.spans) * b.prefix.length for b in batches if b.prefix is not None)
        metrics.shared_prompt_tokens = sum(b.shared_tokens for b in batches)
        metrics.generated_tokens = sum(len(s.token_ids) for s in seqs)
        metrics.peak_memory = context.meter.peaks()
        for seq in self.failed:  # outside the timed span: the scan reads every weight
            seq.error = f"{seq.error}: {context.non_finite_cause()}"
        return metrics

    def _share_results(self) -> None:
        """In a pipeline, the head's device sends the sequences' results and its phases' times to
        the embedding's, which takes them."""
        link, metrics = self.context.link, self.metrics
        if link is None or (link.place.first and link.place.last):
            return
        timing = ("prefill_time", "decode_time", "padded_generated_tokens")
        if link.place.last:
            link.send_results(self.seqs, {name: getattr(metrics, name) for name in timing})
        elif link.place.first:  # the block's phases as the head saw them
            for name, value in link.recv_results(self.seqs).items():
                setattr(metrics, name, value)
