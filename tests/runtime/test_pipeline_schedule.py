"""The block schedule of a pipeline stage: a device runs a contiguous range of the model's stages,
receives each batch's hidden state before the first, sends it after the last, and the tokens the
head's device samples go back to the embedding's device. Checked as pure data: together the
devices run every step of the single-device schedule once, each message is received in the order
it is sent, and no device waits forever."""

import itertools
from dataclasses import replace

import pytest

from flexoff.runtime.schedule import (COMPUTE, FINISH_ATTENTION, HEAD, LOAD_ACTIVATION, LOAD_WEIGHTS, RECV_ACTIVATION,
                                      RECV_TOKENS, RELEASE_WEIGHTS, SEND_ACTIVATION, SEND_TOKENS, START_ATTENTION, STORE_ACTIVATION,
                                      SYNC, block_schedule)
from tests.runtime.test_schedule import KINDS, RUNS, shape

SIZES = list(itertools.product([1, 3], [4, 6], [1, 2, 3]))  # tokens, stages (embedding, layers, head), batches
SHAPES = [shape(*size, **KINDS[kind]) for size in SIZES for kind in KINDS]


def splits(num_stages: int, devices: int):
    """Every way to cut the stages into ``devices`` contiguous, non-empty ranges."""
    for cuts in itertools.combinations(range(1, num_stages), devices - 1):
        edges = (0, *cuts, num_stages)
        yield list(zip(edges, edges[1:]))


CASES = [(block, ranges) for block in SHAPES for devices in (2, 3) for ranges in splits(block.num_stages, devices)]


def schedules(block, ranges):
    return [list(block_schedule(replace(block, first_stage=a, stop_stage=b))) for a, b in ranges]


def where(steps):
    return {(s.kind, s.token, s.stage, s.batch): n for n, s in enumerate(steps)}


@pytest.mark.parametrize("block, ranges", CASES, ids=str)
def test_the_devices_run_every_stage_once_in_the_zig_zag_order(block, ranges):
    single = list(block_schedule(block))
    runs = [[(s.token, s.stage, s.batch) for s in steps if s.kind in RUNS] for steps in schedules(block, ranges)]
    for (a, b), mine in zip(ranges, runs):
        assert mine == [(i, j, k) for i, j, k in ((s.token, s.stage, s.batch) for s in single if s.kind in RUNS)
                        if a <= j < b]
    for steps, (a, b) in zip(schedules(block, ranges), ranges):
        loads = [(s.token, s.stage) for s in steps if s.kind == LOAD_WEIGHTS]
        assert loads == [(i, j) for i in range(block.num_tokens) for j in range(a, b)]
        assert steps[-1].kind == SYNC
        # The ring of two buffers: a load overwrites no weights still read, but those of the stage
        # loaded just before it (here, the last stage comes before the first); a run finds its own.
        loaded, unreleased = set(), set()
        for step in steps:
            if step.kind == LOAD_WEIGHTS:
                previous = step.stage - 1 if step.stage > a else b - 1
                assert all(stage == previous for _, stage, _ in unreleased), step
                loaded.add((step.token, step.stage))
            elif step.kind in RUNS:
                assert (step.token, step.stage) in loaded, step
                unreleased.add((step.token, step.stage, step.batch))
            elif step.kind == RELEASE_WEIGHTS:
                unreleased.remove((step.token, step.stage, step.batch))
        assert not unreleased


@pytest.mark.parametrize("block, ranges", CASES, ids=str)
def test_hidden_states_cross_at_the_edges_and_tokens_go_back_to_the_embedding(block, ranges):
    every = [(i, k) for i in range(block.num_tokens) for k in range(block.num_batches)]
    all_steps = schedules(block, ranges)
    for r, (steps, (a, b)) in enumerate(zip(all_steps, ranges)):
        at = where(steps)
        received = [(s.token, s.batch) for s in steps if s.kind == RECV_ACTIVATION]
        sent = [(s.token, s.batch) for s in steps if s.kind == SEND_ACTIVATION]
        assert received == (every if r > 0 else [])
        assert sent == (every if r < len(ranges) - 1 else [])
        for i, k in received:  # before the first stage here runs, which no activation load feeds
            run = next(kind for kind in RUNS if (kind, i, a, k) in at)
            assert at[(RECV_ACTIVATION, i, a, k)] < at[(run, i, a, k)]
            assert (LOAD_ACTIVATION, i, a, k) not in at
        for i, k in sent:  # after the last stage here has finished, and never stored
            run = next(kind for kind in RUNS if (kind, i, b - 1, k) in at)
            assert at[(run, i, b - 1, k)] < at[(SEND_ACTIVATION, i, b - 1, k)]
            if run == START_ATTENTION:
                assert at[(FINISH_ATTENTION, i, b - 1, k)] < at[(SEND_ACTIVATION, i, b - 1, k)]
            assert (STORE_ACTIVATION, i, b - 1, k) not in at
        heads = [(s.token, s.batch) for s in steps if s.kind == HEAD]
        assert heads == (every if b == block.num_stages else [])
        tokens_sent = [(s.token, s.batch) for s in steps if s.kind == SEND_TOKENS]
        assert tokens_sent == [(i, k) for i, k in heads if i < block.num_tokens - 1]
        for i, k in tokens_sent:
            assert at[(HEAD, i, b - 1, k)] < at[(SEND_TOKENS, i, b - 1, k)]
        tokens_received = [(s.token, s.batch) for s in steps if s.kind == RECV_TOKENS]
        assert tokens_received == ([(i, k) for i, k in every if i > 0] if a == 0 else [])
        for i, k in tokens_received:
            assert at[(RECV_TOKENS, i, 0, k)] < at[(COMPUTE, i, 0, k)]
    # Each device receives its peer's messages in the order the peer sends them.
    for r in range(len(ranges) - 1):
        sent = [(s.token, s.batch) for s in all_steps[r] if s.kind == SEND_ACTIVATION]
        assert sent == [(s.token, s.batch) for s in all_steps[r + 1] if s.kind == RECV_ACTIVATION]


@pytest.mark.parametrize("block, ranges", CASES, ids=str)
def test_no_device_waits_forever(block, ranges):
    """Sends do not wait; a receive waits for its message. Run the devices in turns, each as far as
    it can go: all of them reach the end."""
    all_steps = schedules(block, ranges)
    sent_to = [set() for _ in ranges]  # (kind, token, batch) delivered to each device
    position = [0] * len(ranges)
    last = len(ranges) - 1
    while any(position[r] < len(all_steps[r]) for r in range(len(ranges))):
        moved = False
        for r, steps in enumerate(all_steps):
            while position[r] < len(steps):
                step = steps[position[r]]
                if step.kind in (RECV_ACTIVATION, RECV_TOKENS) and (step.kind, step.token, step.batch) not in sent_to[r]:
                    break
                if step.kind == SEND_ACTIVATION:
                    sent_to[r + 1].add((RECV_ACTIVATION, step.token, step.batch))
                elif step.kind == SEND_TOKENS:
                    sent_to[0].add((RECV_TOKENS, step.token + 1, step.batch))
                position[r] += 1
                moved = True
        assert moved, f"every device waits: {[all_steps[r][position[r]] for r in range(last + 1) if position[r] < len(all_steps[r])]}"


def test_a_device_without_the_head_ends_once_its_peers_say_every_batch_finished():
    """``active`` is cleared by the receives on such a device; once no batch is left the block ends."""
    block = replace(shape(4, 6, 2, travelling=True), first_stage=2, stop_stage=4)
    active = [True, True]
    steps = []
    for step in block_schedule(block, active):
        steps.append(step)
        if step.kind == RECV_ACTIVATION and step.token == 2:  # the previous device says: finished at token 1
            active[step.batch] = False
    assert not [s for s in steps if s.kind in RUNS and s.token >= 2]  # loads issued ahead are all
    assert [(s.kind, s.token, s.batch) for s in steps[-3:]] == [(RECV_ACTIVATION, 2, 0), (RECV_ACTIVATION, 2, 1),
                                                              (SYNC, -1, -1)]


def test_the_head_tells_the_embedding_of_a_batch_that_finished():
    block = replace(shape(4, 5, 2), first_stage=3)
    active = [True, True]
    steps = []
    for step in block_schedule(block, active):
        steps.append(step)
        if step.kind == HEAD and step.token == 1 and step.batch == 0:
            active[0] = False
    at = where(steps)
    assert at[(HEAD, 1, 4, 0)] + 1 == at[(SEND_TOKENS, 1, 4, 0)]
    assert all(s.batch != 0 for s in steps[at[(SEND_TOKENS, 1, 4, 0)] + 1:])


@pytest.mark.parametrize("block, ranges", [(b, r) for b, r in CASES if b.cpu_attention and b.num_tokens > 2], ids=str)
def test_the_next_tokens_first_stage_loads_while_the_last_stages_attention_runs(block, ranges):
    """On a device whose last stage is a decoder layer, its CPU attention at the end of a decode
    token overlaps the load of the next token's first stage, as a layer's overlaps the next layer's."""
    for steps, (a, b) in zip(schedules(block, ranges), ranges):
        if b - 1 not in block.cache_stages or b - a < 2:
            continue
        at = where(steps)
        for i in range(1, block.num_tokens - 1):
            assert at[(LOAD_WEIGHTS, i + 1, a, -1)] < at[(FINISH_ATTENTION, i, b - 1, block.num_batches - 1)]


@pytest.mark.parametrize("block, ranges", [(b, r) for b, r in CASES if len(r) == 2] + [(b, [(0, b.num_stages)])
                                                                                       for b in SHAPES], ids=str)
def test_a_block_run_a_token_at_a_time_takes_the_same_steps(block, ranges):
    """In rotation a block runs one token per turn: the turns together compute, load and send what
    one run of all the tokens does (each turn loading its own first stage), each ending in SYNC."""
    for a, b in ranges:
        mine = replace(block, first_stage=a, stop_stage=b)
        whole = list(block_schedule(mine))
        turns = [list(block_schedule(replace(mine, tokens=range(i, i + 1)))) for i in range(block.num_tokens)]
        for turn, i in zip(turns, range(block.num_tokens)):
            assert turn[-1].kind == SYNC and all(s.token == i for s in turn[:-1])
        joined = [s for turn in turns for s in turn if s.kind != SYNC]
        for kinds in (RUNS, (LOAD_WEIGHTS,), (SEND_ACTIVATION, RECV_ACTIVATION, SEND_TOKENS, RECV_TOKENS, HEAD)):
            assert [s for s in joined if s.kind in kinds] == [s for s in whole if s.kind in kinds]
