"""Block formation: a valid partition, no extra blocks, and less padding than plain chunking."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexoff.runtime.block_forming import form_blocks, padded_tokens

lengths = st.lists(st.tuples(st.integers(1, 300), st.integers(1, 60)), min_size=0, max_size=120)


def sorted_chunks(p, g, size):
    order = sorted(range(len(p)), key=lambda i: (p[i], g[i], i))
    return [order[i:i + size] for i in range(0, len(order), size)]


@settings(max_examples=60, deadline=None)
@given(pairs=lengths, block_size=st.integers(1, 17), gpu_batch=st.integers(1, 17))
def test_blocks_partition_the_prompts_without_extra_blocks(pairs, block_size, gpu_batch):
    p, g = [a for a, _ in pairs], [b for _, b in pairs]
    blocks = form_blocks(p, g, block_size, gpu_batch_size=min(gpu_batch, block_size))
    flat = [i for block in blocks for i in block]
    assert sorted(flat) == list(range(len(p)))
    assert all(1 <= len(block) <= block_size for block in blocks)
    assert len(blocks) <= -(-len(p) // block_size)
    assert form_blocks(p, g, block_size, gpu_batch_size=min(gpu_batch, block_size)) == blocks


@settings(max_examples=60, deadline=None)
@given(pairs=lengths, block_size=st.integers(1, 17))
def test_never_more_padding_than_sorting_on_prompt_length(pairs, block_size):
    p, g = [a for a, _ in pairs], [b for _, b in pairs]
    blocks = form_blocks(p, g, block_size)
    assert padded_tokens(blocks, p, g) <= padded_tokens(sorted_chunks(p, g, block_size), p, g)


def test_groups_on_generation_length_when_prompts_are_alike():
    # Same prompt length, budgets alternating 1 and 100: plain sorting by prompt length pairs
    # each short budget with a long one; grouping on the budget avoids every wasted step.
    p = [10] * 8
    g = [1, 100] * 4
    blocks = form_blocks(p, g, 4)
    assert sorted(sorted(g[i] for i in block) for block in blocks) == [[1] * 4, [100] * 4]
    assert padded_tokens(blocks, p, g) == sum(p) + sum(g)


def test_known_grouping_of_prompt_lengths():
    p = [50, 3, 49, 4, 51, 2]
    blocks = form_blocks(p, [5] * 6, 3)
    assert blocks == [[5, 1, 3], [2, 0, 4]]  # short ones together, ascending inside a block


def test_gpu_batches_inside_a_block_are_grouped_too():
    # The engine pads each GPU batch (consecutive members of a block) on its own. Sorting on
    # prompt length would pair each budget of 1 with one of 100; grouping on the budget does not.
    p = [10, 11, 12, 13, 14, 15, 16, 17]
    g = [1, 100] * 4
    (block,) = form_blocks(p, g, 8, gpu_batch_size=4)
    assert sorted(block) == list(range(8))
    assert sorted(sorted(g[i] for i in block[k:k + 4]) for k in (0, 4)) == [[1] * 4, [100] * 4]
    (plain,) = form_blocks(p, g, 8)
    assert plain == sorted(plain, key=lambda i: p[i])  # without GPU batches: by prompt length


def test_high_efficiency_on_a_skewed_mix():
    rng = np.random.default_rng(3)
    p = np.clip(rng.normal(256, 252, 2000), 1, 512).astype(int).tolist()
    g = np.clip(rng.normal(32, 13, 2000), 1, 80).astype(int).tolist()
    blocks = form_blocks(p, g, 32)
    efficiency = (sum(p) + sum(g)) / padded_tokens(blocks, p, g)
    baseline = (sum(p) + sum(g)) / padded_tokens(sorted_chunks(p, g, 32), p, g)
    assert efficiency > baseline + 0.01


def test_a_weighted_generated_token_groups_on_the_budget():
    # Prompts of 10 and 100, budgets of 1 and 50, blocks of 2. Counted alike, grouping on the
    # prompt pads 2 x 49 + 2 x 49 generated tokens against grouping on the budget's 2 x 90 prompt
    # ones; a generated token worth 10 prompt tokens turns that round.
    p, g = [10, 10, 100, 100], [1, 50, 1, 50]
    by_prompt, by_budget = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    assert sorted(map(sorted, form_blocks(p, g, 2))) == by_prompt
    assert sorted(map(sorted, form_blocks(p, g, 2, budget_weight=10))) == by_budget
    # Inside a block, its GPU batches likewise.
    (block,) = form_blocks(p, g, 4, gpu_batch_size=2, budget_weight=10)
    assert sorted(map(sorted, (block[:2], block[2:]))) == by_budget


@pytest.mark.parametrize("args, message", [
    (([1, 2], [1], 2), "2 prompt lengths but 1"),
    (([1], [1], 0), "block_size"),
    (([1], [1], 2.5), "block_size"),
])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        form_blocks(*args)


@pytest.mark.parametrize("weight", [0, 1.5, -2])
def test_a_budget_weight_is_a_whole_number_of_prompt_tokens(weight):
    with pytest.raises(ValueError, match="budget_weight must be an integer >= 1"):
        form_blocks([1, 2], [1, 1], 2, budget_weight=weight)


def test_empty_job():
    assert form_blocks([], [], 4) == []
