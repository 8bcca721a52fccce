"""Two small blocks' decode steps written out in full: the order the schedule's docstring states,
step by step, so that a change of the schedule's code that changes any step shows here."""

from flexoff.runtime.schedule import HEAD, BlockShape, block_schedule

BOTH = frozenset({0, 1})


def decode_steps(shape: BlockShape) -> list[str]:
    """The steps after the prefill's last HEAD, one "kind token stage batch" each."""
    steps = list(block_schedule(shape))
    last_head = max(n for n, s in enumerate(steps) if s.kind == HEAD and s.token == 0)
    return [" ".join(map(str, s)) for s in steps[last_head + 1:]]


def test_a_travelling_cache_loads_a_batch_ahead_and_reads_disk_rows_a_layer_ahead():
    # Two decoder layers (stages 1 and 2), two GPU batches, caches with disk rows.
    shape = BlockShape(2, 4, 2, frozenset({1, 2}), travelling_cache=BOTH, disk_reads=BOTH)
    assert decode_steps(shape) == [
        "load_weights 1 1 -1",
        "compute 1 0 0", "release_weights 1 0 0",
        "load_cache 1 1 0", "read_cache 1 2 0",  # batch 0's first layer loads, its second is read
        "compute 1 0 1", "release_weights 1 0 1",
        "load_weights 1 2 -1",
        "load_cache 1 1 1", "read_cache 1 2 1",
        "compute 1 1 0", "release_weights 1 1 0",
        "load_cache 1 2 0",  # the last layer's load reads nothing ahead
        "compute 1 1 1", "release_weights 1 1 1",
        "load_weights 1 3 -1",
        "load_cache 1 2 1",
        "compute 1 2 0", "release_weights 1 2 0",
        "compute 1 2 1", "release_weights 1 2 1",
        "compute 1 3 0", "release_weights 1 3 0", "head 1 3 0",
        "compute 1 3 1", "release_weights 1 3 1", "head 1 3 1",
        "sync -1 -1 -1",
    ]


def test_cpu_attention_finishes_a_batch_after_the_next_batchs_gpu_work():
    # One decoder layer (stage 1), two GPU batches, attention on the host.
    shape = BlockShape(2, 3, 2, frozenset({1}), cpu_attention=BOTH)
    assert decode_steps(shape) == [
        "load_weights 1 1 -1",
        "compute 1 0 0", "release_weights 1 0 0",
        "compute 1 0 1", "release_weights 1 0 1",
        "load_weights 1 2 -1",
        "start_attention 1 1 0",
        "start_attention 1 1 1",  # batch 1's GPU half runs while batch 0's attention is on the host
        "finish_attention 1 1 0", "release_weights 1 1 0",
        "compute 1 2 0", "release_weights 1 2 0",
        "finish_attention 1 1 1", "release_weights 1 1 1",
        "head 1 2 0",
        "compute 1 2 1", "release_weights 1 2 1", "head 1 2 1",
        "sync -1 -1 -1",
    ]
