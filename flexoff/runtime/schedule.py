"""The block schedule: FlexGen's zig-zag order as a pure generator of steps.

For each generated token, each stage (embedding, decoder layers, head), each GPU batch:
prefetch the next stage's weights (once per stage, shared by all GPU batches of the block), store
the previous batch's cache and activations, load the next batch's, and compute this batch. Being
pure, the order can be checked without any device.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

LOAD_WEIGHTS = "load_weights"
LOAD_CACHE = "load_cache"
LOAD_ACTIVATION = "load_activation"
COMPUTE = "compute"
STORE_CACHE = "store_cache"
STORE_ACTIVATION = "store_activation"


@dataclass(frozen=True)
class Step:
    kind: str
    token: int
    stage: int
    batch: int = -1  # -1 for weight loads, which serve every batch


def block_schedule(num_tokens: int, num_stages: int, num_batches: int,
                   cache_stages: frozenset[int] = frozenset()) -> Iterator[Step]:
    """Steps of one block. ``cache_stages`` are the stages that own a KV cache (decoder layers).

    Activations flow between stages, so stage 0 (the embedding, fed token ids) loads none, and the
    last stage (the head, which samples) stores none.
    """
    last_stage = num_stages - 1
    order = [(i, j, k) for i in range(num_tokens) for j in range(num_stages) for k in range(num_batches)]

    loaded_activations: set[tuple[int, int, int]] = set()

    def activation_load(i: int, j: int, k: int) -> Iterator[Step]:
        if j > 0 and (i, j, k) not in loaded_activations:
            loaded_activations.add((i, j, k))
            yield Step(LOAD_ACTIVATION, i, j, k)

    def loads(i: int, j: int, k: int) -> Iterator[Step]:
        if j in cache_stages:
            yield Step(LOAD_CACHE, i, j, k)
        yield from activation_load(i, j, k)

    def stores(i: int, j: int, k: int) -> Iterator[Step]:
        if j in cache_stages:
            yield Step(STORE_CACHE, i, j, k)
        if j < last_stage:
            yield Step(STORE_ACTIVATION, i, j, k)

    if order:
        yield Step(LOAD_WEIGHTS, 0, 0)
        yield from loads(*order[0])
    for position, (i, j, k) in enumerate(order):
        if k == 0:
            next_stage = (i, j + 1) if j < last_stage else (i + 1, 0)
            if next_stage[0] < num_tokens:
                yield Step(LOAD_WEIGHTS, *next_stage)
        if position > 0:
            yield from stores(*order[position - 1])
        if position + 1 < len(order):
            ni, nj, nk = order[position + 1]
            if nj in cache_stages:
                yield Step(LOAD_CACHE, ni, nj, nk)
            # The next batch's input may be the output of this very compute (one GPU batch per
            # block); then it is loaded after the compute instead of before.
            if (ni, nj - 1, nk) != (i, j, k):
                yield from activation_load(ni, nj, nk)
        yield from activation_load(i, j, k)
        yield Step(COMPUTE, i, j, k)
    if order:
        yield from stores(*order[-1])
