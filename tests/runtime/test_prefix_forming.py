"""Block forming by shared prefixes: rows sharing a long prefix run in one GPU batch, the padded
tokens (a shared prefix counted once) never exceed the grouping by length, and a job that shares
nothing gets exactly the blocks it gets without its prompts."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexoff.prefixes import MIN_SHARED_PREFIX, common_prefix
from flexoff.runtime.block_forming import form_blocks, padded_tokens


def shared_by_all(prompts: list[list[int]]) -> int:
    """The leading ids every one of ``prompts`` has."""
    return min(common_prefix(prompts[0], other) for other in prompts) if prompts else 0


def families(rng: random.Random, count: int, vocab: int = 3) -> list[list[int]]:
    """Prompts in a few families, each family's prompts beginning with its own prefix (0 to 40
    tokens) and going on in a small vocabulary, so that some share more than their family."""
    heads = [[rng.randrange(100, 200)] + [rng.randrange(vocab) for _ in range(rng.randrange(40))]
             for _ in range(rng.randint(1, 5))]
    return [rng.choice(heads) + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(count)]


def gpu_batches(blocks, size):
    return [block[i:i + size] for block in blocks for i in range(0, len(block), size)]


def few_shot(subjects: int = 6, questions: int = 12, prefix: int = 100, seed: int = 0):
    """An MMLU-shaped job, shuffled: each subject's questions share its in-context examples."""
    rng = random.Random(seed)
    rows = []
    for subject in range(subjects):
        head = [1000 + subject] + [rng.randrange(50000) for _ in range(prefix - 1)]
        rows += [(subject, head + [rng.randrange(50000) for _ in range(rng.randint(10, 60))], rng.randint(1, 4))
                 for _ in range(questions)]
    rng.shuffle(rows)
    return [s for s, _, _ in rows], [ids for _, ids, _ in rows], [b for _, _, b in rows]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), count=st.integers(0, 90), per_block=st.integers(1, 4),
       gpu_batch=st.integers(1, 9), scoring=st.booleans())
def test_a_valid_grouping_never_costlier_than_by_length(seed, count, per_block, gpu_batch, scoring):
    rng = random.Random(seed)
    prompts = families(rng, count)
    budgets = [rng.randint(1, 20) for _ in prompts]
    lens = [len(ids) for ids in prompts]
    keep = [rng.randint(1, 8) for _ in prompts] if scoring else None
    size = per_block * gpu_batch
    blocks = form_blocks(lens, budgets, size, gpu_batch_size=gpu_batch, prompts=prompts, keep=keep)
    assert sorted(i for block in blocks for i in block) == list(range(count))
    assert all(1 <= len(block) <= size for block in blocks)
    assert len(blocks) <= -(-count // size)
    by_length = form_blocks(lens, budgets, size, gpu_batch_size=gpu_batch)
    cost = lambda b: padded_tokens(b, lens, budgets, gpu_batch_size=gpu_batch, prompts=prompts, keep=keep)  # noqa: E731
    assert cost(blocks) <= cost(by_length)
    assert form_blocks(lens, budgets, size, gpu_batch_size=gpu_batch, prompts=prompts, keep=keep) == blocks


@pytest.mark.parametrize("gpu_batch, block_size", [(4, 8), (3, 12), (6, 12), (2, 8), (4, 16), (12, 24)])
def test_every_gpu_batch_of_a_few_shot_job_shares_its_subjects_prefix(gpu_batch, block_size):
    subjects, prompts, budgets = few_shot()
    lens = [len(ids) for ids in prompts]
    blocks = form_blocks(lens, budgets, block_size, gpu_batch_size=gpu_batch, prompts=prompts)
    assert len(blocks) == -(-len(prompts) // block_size)
    for rows in gpu_batches(blocks, gpu_batch):
        assert len({subjects[i] for i in rows}) == 1
        assert shared_by_all([prompts[i] for i in rows]) >= 100
    shared = padded_tokens(blocks, lens, budgets, gpu_batch_size=gpu_batch, prompts=prompts)
    by_length = form_blocks(lens, budgets, block_size, gpu_batch_size=gpu_batch)
    assert shared < padded_tokens(by_length, lens, budgets, gpu_batch_size=gpu_batch, prompts=prompts)


def test_a_subject_that_does_not_fill_its_batches_shares_where_it_does():
    # 12 questions a subject, GPU batches of 8: each subject fills one, its other 4 share nothing.
    subjects, prompts, budgets = few_shot()
    lens = [len(ids) for ids in prompts]
    blocks = form_blocks(lens, budgets, 16, gpu_batch_size=8, prompts=prompts)
    shares = [shared_by_all([prompts[i] for i in rows]) for rows in gpu_batches(blocks, 8)]
    assert sum(s >= 100 for s in shares) == 6


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), count=st.integers(0, 90), per_block=st.integers(1, 4),
       gpu_batch=st.integers(1, 9), common=st.integers(0, MIN_SHARED_PREFIX - 1))
def test_a_job_sharing_less_than_the_minimum_gets_todays_blocks(seed, count, per_block, gpu_batch, common):
    # Every prompt begins with the same ``common`` tokens, short of what pays to share, then differs.
    rng = random.Random(seed)
    head = [7] * common
    prompts = [head + [1000 + i] + [rng.randrange(5) for _ in range(rng.randint(0, 40))] for i in range(count)]
    budgets = [rng.randint(1, 20) for _ in prompts]
    lens = [len(ids) for ids in prompts]
    size = per_block * gpu_batch
    assert (form_blocks(lens, budgets, size, gpu_batch_size=gpu_batch, prompts=prompts)
            == form_blocks(lens, budgets, size, gpu_batch_size=gpu_batch))


def test_rows_that_keep_their_whole_prompt_share_nothing():
    # Prompt logprobs read every position: such rows are formed as though no prompt were given.
    prompts = [[5] * 40 + [i] for i in range(16)]
    lens, budgets = [41] * 16, [2] * 16
    keep = [41] * 16
    assert (form_blocks(lens, budgets, 8, gpu_batch_size=4, prompts=prompts, keep=keep)
            == form_blocks(lens, budgets, 8, gpu_batch_size=4))


def test_a_batch_of_many_contexts_holds_contexts_alike_in_length():
    # 60 contexts of 100-300 tokens, each with four scored continuations, in GPU batches of 20 rows
    # (five contexts): a batch's prefix rows pad to its longest context, so alike lengths run together.
    rng = random.Random(3)
    contexts = [[300 + c] + [rng.randrange(900) for _ in range(rng.randint(100, 300))] for c in range(60)]
    rows = [(c, contexts[c] + [rng.randrange(900) for _ in range(rng.randint(1, 8))]) for c in range(60) for _ in range(4)]
    prompts = [ids for _, ids in rows]
    keep = [len(ids) - len(contexts[c]) + 1 for c, ids in rows]
    lens = [len(ids) for ids in prompts]
    blocks = form_blocks(lens, [1] * len(rows), 20, gpu_batch_size=20, prompts=prompts, keep=keep)
    spreads = []
    for batch in gpu_batches(blocks, 20):
        held = {rows[i][0] for i in batch}
        assert len(held) == 5 and all(sum(rows[i][0] == c for i in batch) == 4 for c in held)
        spreads.append(max(len(contexts[c]) for c in held) - min(len(contexts[c]) for c in held))
    # 60 lengths drawn from 200 values, in sorted runs of five: a few tokens apart, not ~150 as at random.
    assert max(spreads) < 40


def test_samples_and_choices_of_one_context_run_together():
    # Four continuations of each of six contexts, scored: a context's rows share it.
    rng = random.Random(1)
    contexts = [[200 + c] + [rng.randrange(900) for _ in range(rng.randint(30, 80))] for c in range(6)]
    rows = [(c, contexts[c] + [rng.randrange(900) for _ in range(rng.randint(1, 5))]) for c in range(6) for _ in range(4)]
    rng.shuffle(rows)
    prompts = [ids for _, ids in rows]
    keep = [len(ids) - len(contexts[c]) + 1 for c, ids in rows]
    lens = [len(ids) for ids in prompts]
    blocks = form_blocks(lens, [1] * len(rows), 8, gpu_batch_size=4, prompts=prompts, keep=keep)
    for batch in gpu_batches(blocks, 4):
        assert len({rows[i][0] for i in batch}) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[[1, 2]]), "as long as its prompt length"),
    (dict(prompts=[[1, 2, 3], [1, 2]]), "as long as its prompt length"),
    (dict(prompts=[[1, 2, 3]], keep=[1, 1]), "2 keep counts for 1 prompts"),
    (dict(keep=[1]), "give the prompts too"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        form_blocks([3], [1], 2, **kwargs)
