import random

from flexoff.prefixes import MIN_SHARED_PREFIX, batch_prefix, common_prefix


def _naive_common(prompts):
    n = 0
    while all(len(p) > n for p in prompts) and len({p[n] for p in prompts}) == 1:
        n += 1
    return n


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [6]) == 0


def test_batch_prefix_matches_a_plain_count():
    rng = random.Random(0)
    for _ in range(200):
        head = [rng.randrange(4) for _ in range(rng.randrange(40))]
        rows = rng.randrange(1, 5)
        prompts = [head + [rng.randrange(4) for _ in range(rng.randrange(5))] for _ in range(rows)]
        prompts = [p or [1] for p in prompts]
        keep = [rng.randrange(1, 3) for _ in prompts]
        shared = batch_prefix(prompts, keep, minimum=3)
        expect = min(_naive_common(prompts), min(len(p) - k for p, k in zip(prompts, keep)))
        assert shared == (expect if rows > 1 and expect >= 3 else 0)


def test_every_row_keeps_its_last_tokens():
    same = list(range(100))
    # Two samples of one prompt: all but the head's last position is shared.
    assert batch_prefix([same, same]) == 99
    assert batch_prefix([same, same], [10, 1]) == 90
    assert batch_prefix([same]) == 0  # one row shares with nobody
    short = list(range(MIN_SHARED_PREFIX))
    assert batch_prefix([short, short]) == 0  # what is left to share is under the minimum
