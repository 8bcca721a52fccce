"""The block schedule: every step the engine takes to run one block, in the order it takes them.

The order is FlexGen's zig-zag: for each generated token, each stage (embedding, decoder layers,
head), each GPU batch, compute that batch while the next batch's cache and activations load and the
next stage's weights (shared by every GPU batch of the block) load. On top of that order come the
rules that make it overlap:

- A stage's weights load into a ring of two buffers, so loading stage j + 1 may overwrite stage
  j - 1. Its LOAD_WEIGHTS is issued as soon as no batch still has a half-run layer other than j (see
  below); until then it waits, in order, behind the loads before it.
- With CPU attention a batch's decode layer runs in two steps: START_ATTENTION (the GPU half
  before attention, then attention handed to the host worker) and FINISH_ATTENTION (wait for it,
  then the GPU half after). The finish comes when the batch is next needed (its next compute or
  activation load), or at the latest right after the next batch's compute, so that each batch's
  CPU attention runs while the GPU works on its neighbours. A store of its activations waits for
  the finish, and so does the RELEASE_WEIGHTS of the layer's weights.
- RELEASE_WEIGHTS follows every compute (the buffers may be reloaded once the last compute reading
  them is enqueued); the cache's new slot is stored by the compute itself.
- A travelling cache's disk rows are read a layer ahead: READ_CACHE of layer j + 1 comes right
  after the LOAD_CACHE of layer j, so the drive works while layer j loads and computes (the first
  layer's rows are read by its own LOAD_CACHE).
- HEAD (sample or score) comes once the other batches' pending layers are finished; a batch that
  has finished takes no further step, and once none is left the block ends with SYNC (every host
  job done).

Being pure, the schedule can be checked without a device, and the engine only interprets it.

Data the schedule depends on comes back through ``active`` (which batches still run), read
between steps; the generator stays a function of its inputs. A step kind is the name of the
interpreter's method that runs it, so a new kind is one more method there.

A pipeline stage runs a contiguous range of the stages (``BlockShape.first_stage`` up to
``stop_stage``) in the same order: RECV_ACTIVATION before the first stage here of each batch,
SEND_ACTIVATION after the last (once its attention has finished), and, where the head and the
embedding are on different devices, SEND_TOKENS after each HEAD but the last token's and
RECV_TOKENS before the embedding of the next token. A receive comes only after every send this
device owes, so no two devices wait on each other. ``BlockShape.tokens`` runs part of the tokens,
so that blocks in rotation take turns.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

LOAD_WEIGHTS = "load_weights"
LOAD_CACHE = "load_cache"
READ_CACHE = "read_cache"  # disk rows of a travelling cache: read into host staging a layer ahead of LOAD_CACHE
LOAD_ACTIVATION = "load_activation"
COMPUTE = "compute"
START_ATTENTION = "start_attention"
FINISH_ATTENTION = "finish_attention"
STORE_ACTIVATION = "store_activation"
RELEASE_WEIGHTS = "release_weights"
HEAD = "head"
SYNC = "sync"
# Pipeline stages (a contiguous range of the model's stages per device): a batch's hidden state
# crosses to the next device after the last stage it owns here, and the sampled tokens go from the
# device owning the head back to the one owning the embedding.
SEND_ACTIVATION = "send_activation"
RECV_ACTIVATION = "recv_activation"
SEND_TOKENS = "send_tokens"
RECV_TOKENS = "recv_tokens"


class Step(NamedTuple):  # a tuple: made for every step of every block, it must be cheap
    kind: str
    token: int = -1
    stage: int = -1
    batch: int = -1  # -1 for steps that serve every batch (weight loads, the final sync)


@dataclass(frozen=True)
class BlockShape:
    """What the schedule of one block depends on, as plain numbers and sets of batch indices."""

    num_tokens: int
    num_stages: int
    num_batches: int
    cache_stages: frozenset[int] = frozenset()  # stages that own a KV cache (decoder layers)
    cpu_attention: frozenset[int] = frozenset()  # batches whose decode attention runs on the host worker
    travelling_cache: frozenset[int] = frozenset()  # batches whose cache is loaded to the GPU for decode
    offloaded_activations: frozenset[int] = frozenset()  # batches whose activations leave the GPU between stages
    first_stage: int = 0  # the stages this device runs: first_stage up to stop_stage
    stop_stage: int | None = None  # None: to the last stage
    tokens: range | None = None  # the tokens run now (None: all): one at a time, blocks take turns
    disk_reads: frozenset[int] = frozenset()  # travelling batches with disk rows, read a layer ahead

    @property
    def owned(self) -> range:
        return range(self.first_stage, self.num_stages if self.stop_stage is None else self.stop_stage)


def zig_zag(shape: BlockShape) -> Iterator[Step]:
    """The data movement of the zig-zag order, before the overlap rules: weight loads one stage
    ahead, each batch's cache and activation loads one batch ahead of its compute, and its
    activation store one batch behind. Stage 0 (fed token ids) loads no activations and the last
    stage (which samples) stores none; caches load only to decode, and disk rows are read a layer
    ahead of their load."""
    num_batches, owned = shape.num_batches, shape.owned
    tokens = range(shape.num_tokens) if shape.tokens is None else shape.tokens
    first, last_stage = owned.start, owned.stop - 1
    order = [(i, j, k) for i in tokens for j in owned for k in range(num_batches)]
    loaded_activations: set[tuple[int, int, int]] = set()

    def activation_load(i: int, j: int, k: int) -> Iterator[Step]:
        # The first stage here is fed token ids (stage 0) or the previous device's hidden state.
        if j > first and k in shape.offloaded_activations and (i, j, k) not in loaded_activations:
            loaded_activations.add((i, j, k))
            yield Step(LOAD_ACTIVATION, i, j, k)

    def cache_load(i: int, j: int, k: int) -> Iterator[Step]:
        if i > 0 and j in shape.cache_stages and k in shape.travelling_cache:
            yield Step(LOAD_CACHE, i, j, k)
            if k in shape.disk_reads and j + 1 in shape.cache_stages and j < last_stage:
                yield Step(READ_CACHE, i, j + 1, k)  # the drive's latency passes behind this layer's load

    def store(i: int, j: int, k: int) -> Iterator[Step]:
        if j < last_stage and k in shape.offloaded_activations:
            yield Step(STORE_ACTIVATION, i, j, k)

    if order:
        yield Step(LOAD_WEIGHTS, tokens.start, first)
        yield from cache_load(*order[0])
        yield from activation_load(*order[0])
    for position, (i, j, k) in enumerate(order):
        if k == 0:
            next_stage = (i, j + 1) if j < last_stage else (i + 1, first)
            if next_stage[0] < tokens.stop:
                yield Step(LOAD_WEIGHTS, *next_stage)
        if position > 0:
            yield from store(*order[position - 1])
        if position + 1 < len(order):
            ni, nj, nk = order[position + 1]
            yield from cache_load(ni, nj, nk)
            # The next batch's input may be the output of this very compute (one GPU batch per
            # block); then it is loaded after the compute instead of before.
            if (ni, nj - 1, nk) != (i, j, k):
                yield from activation_load(ni, nj, nk)
        yield from activation_load(i, j, k)
        if j == first and first > 0:
            yield Step(RECV_ACTIVATION, i, j, k)
        elif j == 0 and i > 0 and last_stage < shape.num_stages - 1:
            yield Step(RECV_TOKENS, i, j, k)  # the tokens sampled at i - 1, from the head's device
        yield Step(COMPUTE, i, j, k)
        if j == last_stage < shape.num_stages - 1:
            yield Step(SEND_ACTIVATION, i, j, k)
    if order:
        yield from store(*order[-1])


def block_schedule(shape: BlockShape, active: Sequence[bool] | None = None) -> Iterator[Step]:
    """Every step of one block, in the order the engine runs them (see the module's docstring).

    ``active[k]`` says whether batch k still runs (the interpreter passes ``batch.Running``, a view
    of each batch's own record); it is read before each of the batch's steps. None: every batch runs to the end.
    """
    active = [True] * shape.num_batches if active is None else active
    rules = _Overlap(shape)
    for step in zig_zag(shape):
        if not any(active):  # on a device without the head, batches finish as its peers say
            break
        if step.kind == LOAD_WEIGHTS:
            rules.deferred.append(step)
            yield from rules.issue_loads()
        elif active[step.batch]:
            yield from rules.batch_step(step)
    for k in list(rules.pending):  # a device without the head ends on a decoder layer
        yield from rules.finish(k)
    yield Step(SYNC)


class _Overlap:
    """The overlap rules applied to one block's zig-zag steps: which layers are half run, which
    stores or sends wait for their layer's finish, and which weight loads wait for their buffers."""

    def __init__(self, shape: BlockShape):
        self.shape = shape
        self.pending: dict[int, tuple[int, int]] = {}  # batch -> (token, stage) of its half-run layer
        self.leave_on_finish: dict[int, str] = {}  # batch -> the store or send of its output, waiting for its finish
        self.deferred: list[Step] = []  # weight loads waiting for the buffers they overwrite

    def finish(self, k: int) -> Iterator[Step]:
        if k in self.pending:
            token, stage = self.pending.pop(k)
            yield Step(FINISH_ATTENTION, token, stage, k)
            if k in self.leave_on_finish:
                yield Step(self.leave_on_finish.pop(k), token, stage, k)
            yield Step(RELEASE_WEIGHTS, token, stage, k)

    def before(self, stage: int) -> int:
        """The stage loaded just before ``stage``: the last one here comes before the first."""
        owned = self.shape.owned
        return stage - 1 if stage > owned.start else owned.stop - 1

    def issue_loads(self) -> Iterator[Step]:
        # A load may reuse any stage's buffers but those of the stage just before it.
        deferred = self.deferred
        while deferred and all(stage == self.before(deferred[0].stage) for _, stage in self.pending.values()):
            yield deferred.pop(0)

    def batch_step(self, step: Step) -> Iterator[Step]:
        """A step of a batch that still runs, with the finishes and loads that must come around it."""
        k = step.batch
        if step.kind in (LOAD_ACTIVATION, RECV_ACTIVATION, RECV_TOKENS):
            if step.kind != LOAD_ACTIVATION:
                # A receive may wait on a peer that waits for what this device has yet to send.
                for other in [b for b, kind in self.leave_on_finish.items() if kind == SEND_ACTIVATION]:
                    yield from self.finish(other)
            yield from self.finish(k)
            yield step
        elif step.kind in (STORE_ACTIVATION, SEND_ACTIVATION):
            if k in self.pending:
                self.leave_on_finish[k] = step.kind
            else:
                yield step
        elif step.kind == COMPUTE:
            yield from self.compute(step)
        else:  # a cache's read or load: the cache is the batch's own, nothing waits for it
            yield step

    def compute(self, step: Step) -> Iterator[Step]:
        """A batch's stage: whole, or its first half with CPU attention; then the head, at the last stage."""
        shape, (i, j, k) = self.shape, step[1:]
        yield from self.finish(k)
        yield from self.issue_loads()
        if i > 0 and j in shape.cache_stages and k in shape.cpu_attention:
            self.pending[k] = (i, j)
            yield Step(START_ATTENTION, i, j, k)
        else:
            yield step
            yield Step(RELEASE_WEIGHTS, i, j, k)
        for other in range(shape.num_batches):  # their CPU attention overlapped this batch's enqueued GPU work
            if other != k:
                yield from self.finish(other)
        yield from self.issue_loads()
        if j == shape.num_stages - 1:
            yield Step(HEAD, i, j, k)
            # The head's device tells the embedding's device each batch's tokens, unless it is the same one.
            if shape.owned.start > 0 and i < shape.num_tokens - 1:
                yield Step(SEND_TOKENS, i, j, k)  # sent whether or not the batch finished here
