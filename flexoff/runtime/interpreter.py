"""Runs the block schedule: one handler per kind of step, over the block's GPU batches."""

from __future__ import annotations

from collections.abc import Callable

from ..models import Stage
from .batch import GpuBatch
from .pipeline import PipelineLink
from .schedule import (COMPUTE, FINISH_ATTENTION, HEAD, LOAD_ACTIVATION, LOAD_CACHE, LOAD_WEIGHTS, READ_CACHE,
                       RECV_ACTIVATION, RECV_TOKENS, RELEASE_WEIGHTS, SEND_ACTIVATION, SEND_TOKENS, START_ATTENTION,
                       STORE_ACTIVATION, SYNC, BlockShape, Step, block_schedule)
from .tiers import HostWorker
from .weight_store import TieredWeights

HeadHook = Callable[[GpuBatch, dict], None]  # samples or scores a batch from the head's weights
Observer = Callable[[Step], None]


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
    """Takes the schedule's steps one by one; ``observer`` (if any) sees each step before it runs."""

    def __init__(self, batches: list[GpuBatch], stages: list[Stage], weights: TieredWeights, worker: HostWorker,
                 on_head: HeadHook, observer: Observer | None = None, link: PipelineLink | None = None,
                 on_tokens: Callable[[int], None] | None = None):
        self.batches = batches
        self.stages = stages
        self.weights = weights
        self.worker = worker
        self.on_head = on_head
        self.observer = observer
        self.link = link  # a pipeline stage's peers (None: this device runs every stage)
        self.on_tokens = on_tokens  # a pipeline's first device: told of each batch's tokens from the head
        self.active = [True] * len(batches)  # read by the schedule between steps
        self._head_weights: dict[int, dict] = {}

    def run(self, num_tokens: int, tokens: range | None = None) -> None:
        """The block's schedule for ``tokens`` of its ``num_tokens`` (default: all of them)."""
        shape = block_shape(self.batches, num_tokens, len(self.stages), self.link and self.link.place.owned, tokens)
        handlers, observer = _HANDLERS, self.observer
        try:
            for step in block_schedule(shape, self.active):
                if observer is not None:
                    observer(step)
                getattr(self, handlers[step.kind])(step)
        except BaseException:
            self.worker.drain()  # no host job may outlive the block's cache (or hide its error)
            raise

    def load_weights(self, step: Step) -> None:
        self.weights.prefetch(self.stages[step.stage])

    def load_cache(self, step: Step) -> None:
        batch = self.batches[step.batch]
        batch.kv.prefetch(step.stage - 1, batch.slot_start(step.token))

    def read_cache(self, step: Step) -> None:
        batch = self.batches[step.batch]
        batch.kv.read_ahead(step.stage - 1, batch.slot_start(step.token))

    def load_activation(self, step: Step) -> None:
        self.batches[step.batch].load_activation()

    def compute(self, step: Step) -> None:
        """The stage for one batch; the head's weights are kept for the HEAD step, which samples."""
        batch = self.batches[step.batch]
        if step.stage == 0:
            batch.begin_token(step.token)
        weights = self.weights.get(self.stages[step.stage])
        if step.stage == 0:
            batch.embed(weights)
        elif step.stage < len(self.stages) - 1:
            batch.layer(step.stage - 1, weights)
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

    def head(self, step: Step) -> None:
        batch = self.batches[step.batch]
        self.on_head(batch, self._head_weights.pop(step.batch))
        self.active[step.batch] = batch.active

    # A pipeline stage's messages
    def send_activation(self, step: Step) -> None:
        batch = self.batches[step.batch]
        self.link.send_hidden(step.batch, batch.hidden)
        batch.hidden = None

    def recv_activation(self, step: Step) -> None:
        batch = self.batches[step.batch]
        batch.begin_token(step.token)
        batch.hidden = self.link.recv_hidden(step.batch, (*batch.input_ids.shape, batch.cfg.hidden_size))
        if batch.hidden is None:  # finished: the schedule takes no further step of it
            self._finished(step.batch)

    def send_tokens(self, step: Step) -> None:
        batch = self.batches[step.batch]
        self.link.send_tokens(step.batch, batch.seqs, batch.pad)

    def recv_tokens(self, step: Step) -> None:
        batch = self.batches[step.batch]
        came = self.link.recv_tokens(step.batch, batch.seqs)
        if self.on_tokens is not None:
            self.on_tokens(came)
        if all(s.finished for s in batch.seqs):
            self._finished(step.batch)

    def _finished(self, k: int) -> None:
        self.batches[k].active = self.active[k] = False
        if self.link.forwards_marks():
            self.link.send_hidden(k, None)

    def sync(self, step: Step) -> None:
        self.worker.drain()


# Each step kind's handler by name: a table of an interpreter's own bound methods would be a cycle
# that keeps its block (and the block's cache) alive until a garbage collection.
_HANDLERS: dict[str, str] = {
    LOAD_WEIGHTS: "load_weights", LOAD_CACHE: "load_cache", LOAD_ACTIVATION: "load_activation", COMPUTE: "compute",
    START_ATTENTION: "start_attention", FINISH_ATTENTION: "finish_attention", STORE_ACTIVATION: "store_activation",
    RELEASE_WEIGHTS: "release_weights", HEAD: "head", SYNC: "sync", SEND_ACTIVATION: "send_activation",
    RECV_ACTIVATION: "recv_activation", SEND_TOKENS: "send_tokens", RECV_TOKENS: "recv_tokens",
    READ_CACHE: "read_cache",
}
