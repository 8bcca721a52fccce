"""A layer's cache state (kv_state.LayerKV), driven directly, and the cache's steps checked against
it: a step out of order raises instead of reading stale slots. No thread runs here."""

from concurrent.futures import Future

import pytest
import torch

from flexoff.models.common import attention
from flexoff.policy import Policy, TierFractions
from flexoff.runtime.kv_state import KVStateError, LayerKV, Load, Phase
from tests.runtime.test_compressed_cache import BIG_HEADS, batch_caches


def done(value=None) -> Future:
    future = Future()
    future.set_result(value)
    return future


def test_a_decode_step_goes_read_ahead_then_loaded_then_idle():
    state = LayerKV(3)
    read, load = done(), Load(1, "ready", done("copied"))
    assert state.take_read() is None and state.phase is Phase.IDLE  # no read made ahead: nothing to take
    state.read_ahead(7, read)
    assert state.phase is Phase.READ
    assert state.take_read() == (7, read) and state.phase is Phase.IDLE
    state.loaded(load)
    assert state.phase is Phase.LOADED
    assert state.take_load() is load and state.phase is Phase.IDLE


def test_writes_are_kept_until_the_next_load_or_read_takes_them():
    state = LayerKV(0)
    assert state.take_stored() is None and state.take_written() is None
    job = done()
    state.streamed("first")
    state.streamed("second")  # the store stream runs in order: the last write is the one to wait for
    state.wrote(job)
    assert state.take_stored() == "second" and state.take_stored() is None
    assert state.take_written() is job and state.take_written() is None


@pytest.mark.parametrize("steps, illegal", [
    ([], lambda s: s.take_load()),  # attention with no load
    ([lambda s: s.loaded(Load(0, None, None))], lambda s: s.loaded(Load(1, None, None))),  # loaded twice
    ([lambda s: s.read_ahead(4, done())], lambda s: s.loaded(Load(0, None, None))),  # a read ahead left behind
    ([lambda s: s.read_ahead(4, done())], lambda s: s.read_ahead(4, done())),  # read twice
    ([lambda s: s.loaded(Load(0, None, None))], lambda s: s.read_ahead(4, done())),  # read while loaded
    ([lambda s: s.read_ahead(4, done())], lambda s: s.streamed(None)),  # a write the read would miss
    ([lambda s: s.loaded(Load(0, None, None))], lambda s: s.wrote(done())),  # a write the load would miss
])
def test_a_transition_out_of_order_raises_and_leaves_the_state(steps, illegal):
    state = LayerKV(5)
    for step in steps:
        step(state)
    before = state.phase
    with pytest.raises(KVStateError, match="layer 5"):
        illegal(state)
    assert state.phase is before


def travelling_cpu_cache():
    """A batch's cache whose rows all travel from the host (on the CPU: copies on the main thread)."""
    policy = Policy(gpu_batch_size=6, cache=TierFractions(0, 1, 0))
    [cache] = batch_caches(policy, disk=None)
    assert cache.travels and not cache.reads_ahead
    return cache


def step_inputs(seq: int, keys: int, rows=6):
    """A step's queries, new keys and values of ``seq`` positions, and a mask over ``keys`` slots
    letting every query see them all."""
    cfg = BIG_HEADS
    q = torch.randn(rows, cfg.num_heads, seq, cfg.head_dim, dtype=torch.float16)
    k, v = (torch.randn(rows, cfg.num_kv_heads, seq, cfg.head_dim, dtype=torch.float16) for _ in range(2))
    return q, k, v, torch.ones(rows, 1, seq, keys, dtype=torch.bool)


def test_the_attention_takes_what_load_cache_loaded_and_only_that():
    cache = travelling_cpu_cache()
    torch.manual_seed(0)
    q, k, v, mask = step_inputs(5, 5)
    cache.attender(1, 0, mask)(q, k, v)  # the prefill stores slots 0..4
    keys, values = k, v
    for start in (5, 6):
        q, k, v, mask = step_inputs(1, start + 1)
        with pytest.raises(KVStateError, match="no LOAD_CACHE"):
            cache.attender(1, start, mask)(q, k, v)  # the attention does not load for itself
        cache.prefetch(1, start)
        with pytest.raises(KVStateError, match="loaded"):
            cache.prefetch(1, start)
        out = cache.attender(1, start, mask)(q, k, v)
        keys, values = torch.cat((keys, k), 2), torch.cat((values, v), 2)
        torch.testing.assert_close(out, attention(q, keys, values, mask))
