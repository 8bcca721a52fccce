"""Runs the block schedule: one handler per kind of step, over the block's GPU batches. It hands
its owner what happened as events (a head ready to sample or score, tokens taken from a
pipeline's head device, a batch finished) and calls nothing of its owner's."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ..models import Stage
from .batch import GpuBatch, Running
from .decode_graphs import DecodeGraphs
from .pipeline import PipelineLink
from .schedule import BlockShape, Step, block_schedule
from .tiers import HostWorker
from .weight_store import TieredWeights

Observer = Callable[[Step], None]


@dataclass(frozen=True)
class HeadReady:
    """Batch ``batch`` has been through the last stage and the head's ``weights`` are ready: its
    owner samples or scores it now, before the schedule goes on."""

    batch: int
    weights: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class TokensTaken:
    """A pipeline's first device took ``count`` new tokens of batch ``batch`` from the head's device."""

    batch: int
    count: int


@dataclass(frozen=True)
class BatchFinished:
    """Batch ``batch`` takes no further step: its sequences have all finished, or (on a pipeline's
    device without the head or the embedding) the device before said so."""

    batch: int


Event = HeadReady | TokensTaken | BatchFinished


def block_shape(batches: list[GpuBatch], num_tokens: int, num_stages: int, owned: range | None = None,
                tokens: range | None = None) -> BlockShape:
    """What the schedule needs to know of the block's batches (and of the stages and tokens run now)."""
    owned = owned or range(num_stages)

    def having(fact: Callable[[GpuBatch], bool]) -> frozenset[int]:
        return frozenset(k for k, batch in enumerate(batches) if fact(batch))

    return BlockShape(num_tokens, num_stages, len(batches), frozenset(range(1, num_stages - 1)),
                      cpu_attention=having(lambda b: b.kv.decodes_on_host),
                      travelling_cache=having(lambda b: b.kv.travels),
                      disk_reads=having(lambda b: b.kv.reads_ahead),
                      offloaded_activations=having(lambda b: b.activations.offloaded),
                      first_stage=owned.start, stop_stage=owned.stop, tokens=tokens)


class BlockInterpreter:
    """Takes the schedule's steps one by one. Each step kind is the name of its handler (the
    method ``compute`` runs a COMPUTE step), so a new kind is one more method; a handler returns
    the event its step makes, or None. ``observer`` (if any) sees each step before it runs."""

    def __init__(self, batches: list[GpuBatch], stages: list[Stage], weights: TieredWeights, worker: HostWorker,
                 observer: Observer | None = None, link: PipelineLink | None = None,
                 graphs: DecodeGraphs | None = None):
        self.batches = batches
        self.graphs = graphs  # decode layers' CUDA graphs (None: layers run eagerly)
        self.stages = stages
        self.weights = weights
        self.worker = worker
        self.observer = observer
        self.link = link  # a pipeline stage's peers (None: this device runs every stage)
        self.running = Running(batches)  # which batches still run: read by the schedule between steps
        self._head_weights: dict[int, Mapping[str, torch.Tensor]] = {}

    def run(self, num_tokens: int, tokens: range | None = None) -> Iterator[Event]:
        """The block's schedule for ``tokens`` of its ``num_tokens`` (default: all of them), as the
        events of its steps. The schedule goes on once the owner asks for the next event, and then
        reads what the owner did with this one (a head step's sampling finishes sequences): a batch
        whose sequences have all finished leaves it, with a BatchFinished. An owner that stops early
        closes the iterator (``contextlib.closing``), which waits for the host's jobs."""
        shape = block_shape(self.batches, num_tokens, len(self.stages), self.link and self.link.place.owned, tokens)
        observer = self.observer
        try:
            for step in block_schedule(shape, self.running):
                if observer is not None:
                    observer(step)
                event = getattr(self, step.kind)(step)
                if event is not None:
                    yield event
                    if self._all_finished(event.batch):
                        yield self._finished(event.batch)
        except BaseException:
            self.worker.drain()  # no host job may outlive the block's cache (or hide its error)
            raise

    def load_weights(self, step: Step) -> None:
        self.weights.prefetch(self.stages[step.stage])

    def load_cache(self, step: Step) -> None:
        self.batches[step.batch].prefetch(step.stage - 1, step.token)

    def read_cache(self, step: Step) -> None:
        self.batches[step.batch].read_ahead(step.stage - 1, step.token)

    def load_activation(self, step: Step) -> None:
        self.batches[step.batch].load_activation()

    def compute(self, step: Step) -> None:
        """The stage for one batch; the head's weights are kept for the HEAD step."""
        batch = self.batches[step.batch]
        if step.stage == 0:
            batch.begin_token(step.token)
        weights = self.weights.get(self.stages[step.stage])
        if step.stage == 0:
            batch.embed(weights)
        elif step.stage < len(self.stages) - 1:
            batch.layer(step.stage - 1, weights, self.graphs)
        else:
            self._head_weights[step.batch] = weights

    def start_attention(self, step: Step) -> None:
        self.batches[step.batch].start_attention(step.stage - 1, self.weights.get(self.stages[step.stage]))

    def finish_attention(self, step: Step) -> None:
        self.batches[step.batch].finish_attention()

    def store_activation(self, step: Step) -> None:
        self.batches[step.batch].store_activation()

    def release_weights(self, step: Step) -> None:
        self.weights.release(self.stages[step.stage])

    def head(self, step: Step) -> HeadReady:
        return HeadReady(step.batch, self._head_weights.pop(step.batch))

    # A pipeline stage's messages
    def send_activation(self, step: Step) -> None:
        batch = self.batches[step.batch]
        self.link.send_hidden(step.batch, batch.hidden)
        batch.hidden = None

    def recv_activation(self, step: Step) -> BatchFinished | None:
        batch = self.batches[step.batch]
        batch.begin_token(step.token)
        batch.hidden = self.link.recv_hidden(step.batch, (*batch.input_ids.shape, batch.cfg.hidden_size))
        return self._finished(step.batch) if batch.hidden is None else None

    def send_tokens(self, step: Step) -> None:
        batch = self.batches[step.batch]
        self.link.send_tokens(step.batch, batch.seqs, batch.pad)

    def recv_tokens(self, step: Step) -> TokensTaken:
        return TokensTaken(step.batch, self.link.recv_tokens(step.batch, self.batches[step.batch].seqs))

    def _all_finished(self, k: int) -> bool:
        """Whether batch k still runs though each of its sequences has finished (at the head, or as
        the head's device told the embedding's)."""
        batch = self.batches[k]
        return batch.active and all(s.finished for s in batch.seqs)

    def _finished(self, k: int) -> BatchFinished:
        """Batch k leaves the schedule; the devices after this one hear of it, up to the head's."""
        self.batches[k].retire()
        if self.link is not None and self.link.forwards_marks():
            self.link.send_hidden(k, None)
        return BatchFinished(k)

    def sync(self, step: Step) -> None:
        self.worker.drain()
