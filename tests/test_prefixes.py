import random

from flexoff.prefixes import MIN_SHARED_PREFIX, batch_groups, common_prefix


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


def test_every_row_keeps_its_last_tokens():
    same = list(range(100))
    # Two samples of one prompt: all but the head's last position is shared.
    assert batch_groups([same, same]) == [([0, 1], 99)]
    assert batch_groups([same, same], [10, 1]) == [([0, 1], 90)]
    assert batch_groups([same]) == []  # one row shares with nobody
    short = list(range(MIN_SHARED_PREFIX))
    assert batch_groups([short, short]) == []  # what is left to share is under the minimum


def test_batch_groups_keep_subjects_apart():
    preamble = list(range(100, 120))
    physics, history = preamble + list(range(40)), preamble + list(range(50, 90))
    prompts = [physics + [1], history + [2], physics + [3, 4], history + [5], [7] * 30, physics + [6]]
    groups = batch_groups(prompts)
    # Three physics rows and two history rows, each group its subject's prefix; the odd row out alone.
    assert sorted((sorted(rows), shared) for rows, shared in groups) == [([0, 2, 5], 60), ([1, 3], 60)]


def test_batch_groups_match_an_exhaustive_search():
    rng = random.Random(1)
    for _ in range(60):
        heads = [[rng.randrange(3) for _ in range(rng.randrange(2, 9))] for _ in range(2)]
        prompts = [rng.choice(heads) + [rng.randrange(3) for _ in range(rng.randrange(1, 4))]
                   for _ in range(rng.randrange(1, 6))]
        groups = batch_groups(prompts, minimum=2)
        seen = [r for rows, _ in groups for r in rows]
        assert len(seen) == len(set(seen))
        for rows, shared in groups:
            assert len(rows) >= 2 and shared >= 2
            assert shared == min(_naive_common([prompts[r] for r in rows]), min(len(prompts[r]) - 1 for r in rows))
        saved = sum((len(rows) - 1) * shared for rows, shared in groups)
        best, _ = _best_saving(prompts, 2)
        # The best split, where the batch padded to the longest own part computes fewer positions.
        assert saved in (0, best)
        if saved:
            assert _padded(prompts, groups) < len(prompts) * max(map(len, prompts))


def test_a_batch_shares_only_where_its_padding_pays():
    head = list(range(100, 130))
    # Two rows share 30 ids, but the third, unshared and longest, sets every row's padding.
    assert batch_groups([head + [1], head + [2], list(range(60))]) == []
    assert batch_groups([head + [1], head + [2], list(range(20))]) == [([0, 1], 30)]


def _padded(prompts, groups):
    own = [len(p) for p in prompts]
    for rows, shared in groups:
        for r in rows:
            own[r] -= shared
    return len(groups) * max(shared for _, shared in groups) + len(prompts) * max(own)


def _best_saving(prompts, minimum):
    """The most prefill tokens any split of the sorted rows into runs saves, and its groups, by brute force."""
    order = sorted(range(len(prompts)), key=lambda r: prompts[r])
    best, best_groups = 0, []
    for mask in range(1 << max(0, len(order) - 1)):
        runs, run = [], [order[0]] if order else []
        for i in range(1, len(order)):
            if mask >> (i - 1) & 1:
                runs.append(run)
                run = []
            run.append(order[i])
        runs.append(run)
        total, groups = 0, []
        for run in runs:
            if len(run) > 1:
                shared = min(_naive_common([prompts[r] for r in run]), min(len(prompts[r]) - 1 for r in run))
                if shared >= minimum:
                    total += (len(run) - 1) * shared
                    groups.append((run, shared))
        if total > best:
            best, best_groups = total, groups
    return best, best_groups
