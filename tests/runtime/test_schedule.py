"""The block schedule, checked as pure data (readiness of inputs, the ring of weight buffers, the
overlap it promises), and against the steps the engine actually runs."""

import itertools

import pytest

from flexoff import LLM, Policy, SamplingParams, TierFractions
from flexoff.runtime.schedule import (COMPUTE, FINISH_ATTENTION, HEAD, LOAD_ACTIVATION, LOAD_CACHE, LOAD_WEIGHTS,
                                      READ_CACHE, RELEASE_WEIGHTS, START_ATTENTION, STORE_ACTIVATION, SYNC, BlockShape,
                                      block_schedule)

RUNS = (COMPUTE, START_ATTENTION)  # steps that enqueue a batch's GPU work for a stage


def shape(num_tokens, num_stages, num_batches, cpu_attention=False, travelling=False, offloaded=False, disk=False):
    every = frozenset(range(num_batches))
    return BlockShape(num_tokens, num_stages, num_batches, frozenset(range(1, num_stages - 1)),
                      cpu_attention=every if cpu_attention else frozenset(),
                      travelling_cache=every if travelling else frozenset(),
                      offloaded_activations=every if offloaded else frozenset(),
                      disk_reads=every if disk else frozenset())


SIZES = list(itertools.product([1, 3], [3, 5], [1, 2, 3]))  # tokens, stages, batches
KINDS = {  # how the caches and activations of the batches are placed
    "on-gpu": {},
    "travelling": {"travelling": True},
    "travelling-offloaded": {"travelling": True, "offloaded": True},
    "travelling-disk": {"travelling": True, "disk": True},
    "cpu-attention": {"cpu_attention": True},
    "cpu-attention-offloaded": {"cpu_attention": True, "offloaded": True},
}
SHAPES = [shape(*size, **KINDS[kind]) for size in SIZES for kind in KINDS]


def simulate(block: BlockShape, active=None):
    """Replay the steps, tracking what is resident, and assert every step finds what it needs."""
    steps = list(block_schedule(block, active))
    last = block.num_stages - 1
    issued = []  # weight loads
    unreleased = set()  # (token, stage, batch) computed or started, not yet released
    started, hidden_ready, stored, cache_loaded, cache_read = set(), set(), set(), set(), set()
    computes = []
    for n, step in enumerate(steps):
        key = (step.token, step.stage, step.batch)
        if step.kind == LOAD_WEIGHTS:
            # The ring of two: the buffers it overwrites are read by no compute still running,
            # except those of the stage just before it.
            assert all(s == step.stage - 1 for _, s, _ in unreleased), f"{key} overwrites weights in use"
            issued.append((step.token, step.stage))
        elif step.kind == LOAD_CACHE:
            assert step.token > 0 and step.batch in block.travelling_cache
            # Disk rows are read while the layer before loads (the first layer's by its own load).
            read_ahead = step.batch in block.disk_reads and step.stage - 1 in block.cache_stages
            assert (key in cache_read) == read_ahead, f"{key}: read ahead {'missing' if read_ahead else 'unasked'}"
            cache_loaded.add(key)
        elif step.kind == READ_CACHE:
            assert step.batch in block.disk_reads and (step.token, step.stage - 1, step.batch) in cache_loaded
            assert key not in cache_loaded and key not in cache_read
            cache_read.add(key)
        elif step.kind == LOAD_ACTIVATION:
            assert (step.token, step.stage - 1, step.batch) in stored, f"{key} loads an activation not stored"
            assert step.batch not in {b for _, _, b in started}, "a half-run layer's output is loaded"
            hidden_ready.add(key)
        elif step.kind in RUNS:
            assert (step.token, step.stage) in issued, f"{key} computes before its weights load"
            assert step.batch not in {b for _, _, b in started}, f"{key} runs before the batch's layer finished"
            if step.token > 0 and step.stage in block.cache_stages and step.batch in block.travelling_cache:
                assert key in cache_loaded
            if step.stage > 0 and step.batch in block.offloaded_activations:
                assert key in hidden_ready
            decode_on_host = step.token > 0 and step.stage in block.cache_stages and step.batch in block.cpu_attention
            assert (step.kind == START_ATTENTION) == decode_on_host
            computes.append(key)
            unreleased.add(key)
            if step.kind == START_ATTENTION:
                started.add(key)
        elif step.kind == FINISH_ATTENTION:
            started.remove(key)
        elif step.kind == RELEASE_WEIGHTS:
            assert key not in started, f"{key} released while its layer is half run"
            unreleased.remove(key)
        elif step.kind == STORE_ACTIVATION:
            assert key in computes, f"{key} stored before it was computed"
            assert key not in started, f"{key} stored before its layer finished"
            stored.add(key)
        elif step.kind == HEAD:
            assert step.stage == last and key in computes and key not in unreleased
        else:
            assert step.kind == SYNC and n == len(steps) - 1
    assert not started and not unreleased
    return steps, computes


def index_of(steps):
    return {(s.kind, s.token, s.stage, s.batch): n for n, s in enumerate(steps)}


@pytest.mark.parametrize("block", SHAPES, ids=str)
def test_every_step_finds_its_inputs(block):
    simulate(block)


@pytest.mark.parametrize("block", SHAPES, ids=str)
def test_zig_zag_order(block):
    _, computes = simulate(block)
    assert computes == [(i, j, k) for i in range(block.num_tokens) for j in range(block.num_stages)
                        for k in range(block.num_batches)]


@pytest.mark.parametrize("block", SHAPES, ids=str)
def test_weights_load_once_per_stage_and_token_and_release_after_each_compute(block):
    steps, computes = simulate(block)
    loads = [(s.token, s.stage) for s in steps if s.kind == LOAD_WEIGHTS]
    assert loads == [(i, j) for i in range(block.num_tokens) for j in range(block.num_stages)]
    assert sorted((s.token, s.stage, s.batch) for s in steps if s.kind == RELEASE_WEIGHTS) == sorted(computes)


@pytest.mark.parametrize("block", [s for s in SHAPES if not s.cpu_attention], ids=str)
def test_next_stage_loads_before_this_stage_computes(block):
    """Without CPU attention, layer j + 1's weights load before any batch computes layer j, and
    batch k + 1's cache loads before batch k computes."""
    steps, _ = simulate(block)
    at = index_of(steps)
    for i, j, k in itertools.product(range(block.num_tokens), range(block.num_stages - 1), range(block.num_batches)):
        assert at[(LOAD_WEIGHTS, i, j + 1, -1)] < at[(COMPUTE, i, j, 0)]
        if i > 0 and j + 1 in block.cache_stages and block.travelling_cache and k + 1 < block.num_batches:
            assert at[(LOAD_CACHE, i, j + 1, k + 1)] < at[(COMPUTE, i, j + 1, k)]


@pytest.mark.parametrize("block", [s for s in SHAPES if s.cpu_attention and s.num_tokens > 1], ids=str)
def test_cpu_attention_runs_while_the_next_gpu_work_is_enqueued(block):
    """A batch's decode layer finishes only after the GPU work that follows it in the zig-zag order
    (another batch's, or the next stage's) is enqueued, unless that work needs it; its activation store waits for the finish,
    and the next layer's weights load as soon as no half-run layer reads the buffers they replace."""
    steps, computes = simulate(block)
    at = index_of(steps)
    order = {key: n for n, key in enumerate(computes)}
    for i, j, k in itertools.product(range(1, block.num_tokens), sorted(block.cache_stages), range(block.num_batches)):
        start, finish = at[(START_ATTENTION, i, j, k)], at[(FINISH_ATTENTION, i, j, k)]
        after = computes[order[(i, j, k)] + 1]
        enqueued = at[next(kind for kind in RUNS if (kind, *after) in at), *after]
        # The next GPU work needs this very layer's output with one batch; with two and activations
        # off the GPU, the activation load one batch ahead of the next stage needs it.
        needed = block.num_batches == 1 or (block.num_batches == 2 and block.offloaded_activations)
        assert (finish < enqueued) if needed else (start < enqueued < finish)
        if order[(i, j, k)] + 2 < len(computes):  # and at the latest right after that work
            then = computes[order[(i, j, k)] + 2]
            assert finish < at[next(kind for kind in RUNS if (kind, *then) in at), *then]
        if (STORE_ACTIVATION, i, j, k) in at:
            assert finish < at[(STORE_ACTIVATION, i, j, k)]
        # Layer j + 1 loads once layer j - 1 is finished everywhere: before the second batch starts j.
        first_reader = (START_ATTENTION, i, j, min(1, block.num_batches - 1))
        assert at[(LOAD_WEIGHTS, i, j + 1, -1)] < at[first_reader]


def test_batches_that_finish_take_no_further_step():
    """``active`` is read between steps: a batch cleared at its HEAD takes no later step, and the
    block ends with SYNC once none is left."""
    block = shape(4, 4, 3, cpu_attention=True, offloaded=True)
    active = [True] * 3
    ends = {0: 1, 1: 3, 2: 2}  # the token at whose HEAD each batch finishes
    steps = []
    for step in block_schedule(block, active):
        steps.append(step)
        if step.kind == HEAD and step.token == ends[step.batch]:
            active[step.batch] = False
    for batch, end in ends.items():
        head = index_of(steps)[(HEAD, end, 3, batch)]
        assert all(s.batch != batch for s in steps[head + 1:])
    assert steps[-1].kind == SYNC and steps[-2] == next(s for s in steps if s.kind == HEAD and s.token == 3)
    # The others' order is what it was for them: replaying the same ends checks it is consistent.
    replay = list(block_schedule(block, [True] * 3))
    assert [s for s in steps if s.batch in (-1, 1)][:20] == [s for s in replay if s.batch in (-1, 1)][:20]


# The engine runs the schedule: the steps it takes are the schedule's, under several policies.
ENGINE_CASES = {
    "gpu": (Policy(gpu_batch_size=2, num_gpu_batches=2), {}),
    "cache-cpu-one-batch": (Policy(gpu_batch_size=4, num_gpu_batches=1, cache=TierFractions(0, 1, 0)),
                            {"travelling": True}),
    "no-overlap-disk": (Policy(gpu_batch_size=2, num_gpu_batches=2, overlap=False, cache=TierFractions(0, 0, 1),
                               activations=TierFractions(0, 0, 1), weights=TierFractions(0, 0.5, 0.5)),
                        {"travelling": True, "offloaded": True, "disk": True}),
    "cpu-attention": (Policy(gpu_batch_size=2, num_gpu_batches=2, cpu_attention=True, cache=TierFractions(0, 1, 0),
                             activations=TierFractions(0, 1, 0), weights=TierFractions(0, 1, 0)),
                      {"cpu_attention": True, "offloaded": True}),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_the_engine_runs_the_schedules_steps(tiny_model_dir, tmp_path, case):
    policy, placement = ENGINE_CASES[case]
    path, _ = tiny_model_dir("llama-gqa")
    prompts = [[5, 6, 7][:1 + n % 3] for n in range(policy.block_size)]  # one block
    with LLM(str(path), policy=policy, offload_dir=str(tmp_path)) as llm:
        ran = []
        llm.engine.observer = ran.append
        llm.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True))
        stages = 2 + llm.config.num_layers
    expected = list(block_schedule(shape(3, stages, policy.num_gpu_batches, **placement)))
    assert ran == expected


@pytest.mark.parametrize("case", ["gpu", "cpu-attention"])
def test_the_engine_runs_the_schedules_steps_as_batches_finish(tiny_model_dir, tmp_path, case):
    """Batches that finish early leave the schedule at their HEAD; the engine's steps are those of
    the schedule told the same (the token at which each batch's HEAD was its last)."""
    policy, placement = ENGINE_CASES[case]
    path, _ = tiny_model_dir("llama-gqa")
    prompts = [[5, 6, 7][:1 + n % 3] for n in range(policy.block_size)]
    budgets = [1, 1, 4, 4][:policy.block_size]  # the first batch stops after its prefill
    with LLM(str(path), policy=policy, offload_dir=str(tmp_path)) as llm:
        ran = []
        llm.engine.observer = ran.append
        llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in budgets])
        stages = 2 + llm.config.num_layers
    heads = [s for s in ran if s.kind == HEAD]
    ends = {k: max(s.token for s in heads if s.batch == k) for k in range(policy.num_gpu_batches)}
    assert sorted(ends.values()) == [0, 3]
    active = [True] * policy.num_gpu_batches
    expected = []
    for step in block_schedule(shape(4, stages, policy.num_gpu_batches, **placement), active):
        expected.append(step)
        if step.kind == HEAD and step.token == ends[step.batch]:
            active[step.batch] = False
    assert ran == expected
