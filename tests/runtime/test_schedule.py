"""The block schedule, checked as pure data: order, readiness of inputs, and working-set bounds."""

import itertools

import pytest

from flexoff.runtime.schedule import (COMPUTE, LOAD_ACTIVATION, LOAD_CACHE, LOAD_WEIGHTS, STORE_ACTIVATION,
                                      STORE_CACHE, block_schedule)

SHAPES = list(itertools.product([1, 3], [3, 5], [1, 2, 3]))  # tokens, stages, batches


def simulate(num_tokens, num_stages, num_batches):
    """Replay the steps, tracking what is resident, and assert every compute finds its inputs."""
    cache_stages = frozenset(range(1, num_stages - 1))
    steps = list(block_schedule(num_tokens, num_stages, num_batches, cache_stages))
    weights_loaded, caches_loaded, activations_loaded = [], set(), set()
    produced, stored = set(), set()
    max_weight_sets = max_cache_sets = 0
    computes = []
    for step in steps:
        key = (step.token, step.stage, step.batch)
        if step.kind == LOAD_WEIGHTS:
            weights_loaded.append((step.token, step.stage))
        elif step.kind == LOAD_CACHE:
            assert step.stage in cache_stages
            # Everything this batch wrote to this layer's cache at earlier tokens is stored first.
            for token in range(step.token):
                assert (token, step.stage, step.batch) in stored
            caches_loaded.add(key)
        elif step.kind == LOAD_ACTIVATION:
            producer = (step.token, step.stage - 1, step.batch)
            assert producer in produced and producer in stored, f"{key} loads an activation not yet stored"
            activations_loaded.add(key)
        elif step.kind == COMPUTE:
            assert (step.token, step.stage) in weights_loaded, f"{key} computes before its weights load"
            if step.stage in cache_stages:
                assert key in caches_loaded
            if step.stage > 0:
                assert key in activations_loaded
            produced.add(key)
            computes.append(key)
            # Weights of at most this stage and the next are needed at once: the ring of two.
            live = {ts for ts in weights_loaded if ts >= (step.token, step.stage)}
            max_weight_sets = max(max_weight_sets, len(live))
            pending = {c for c in caches_loaded if c not in produced}
            max_cache_sets = max(max_cache_sets, len(pending) + 1)
        elif step.kind in (STORE_CACHE, STORE_ACTIVATION):
            assert key in produced, f"{key} stored before it was computed"
            stored.add(key)
    return steps, computes, max_weight_sets, max_cache_sets


@pytest.mark.parametrize("num_tokens, num_stages, num_batches", SHAPES)
def test_every_compute_finds_its_inputs(num_tokens, num_stages, num_batches):
    _, computes, max_weight_sets, max_cache_sets = simulate(num_tokens, num_stages, num_batches)
    assert max_weight_sets <= 2
    assert max_cache_sets <= 2


@pytest.mark.parametrize("num_tokens, num_stages, num_batches", SHAPES)
def test_zig_zag_order(num_tokens, num_stages, num_batches):
    _, computes, _, _ = simulate(num_tokens, num_stages, num_batches)
    expected = [(i, j, k) for i in range(num_tokens) for j in range(num_stages) for k in range(num_batches)]
    assert computes == expected


@pytest.mark.parametrize("num_tokens, num_stages, num_batches", SHAPES)
def test_weights_load_once_per_stage_and_token(num_tokens, num_stages, num_batches):
    steps, _, _, _ = simulate(num_tokens, num_stages, num_batches)
    loads = [(s.token, s.stage) for s in steps if s.kind == LOAD_WEIGHTS]
    assert loads == [(i, j) for i in range(num_tokens) for j in range(num_stages)]


def test_next_batch_loads_while_this_one_computes():
    """With several batches, batch k+1's cache load comes before batch k's compute (overlap)."""
    steps = list(block_schedule(2, 4, 3, frozenset({1, 2})))
    index = {(s.kind, s.token, s.stage, s.batch): n for n, s in enumerate(steps)}
    assert index[(LOAD_CACHE, 1, 2, 1)] < index[(COMPUTE, 1, 2, 0)]
    assert index[(LOAD_WEIGHTS, 1, 3, -1)] < index[(COMPUTE, 1, 2, 0)]
