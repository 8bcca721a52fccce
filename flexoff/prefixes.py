"""Shared prompt prefixes: how many leading token ids prompts have in common, and where sharing pays.

A GPU batch whose rows all begin with the same ids runs that prefix once: its prefill computes it
as one row, its cache holds one copy of its keys and values, and each row's own tokens (the rest of
its prompt, then what it generates) attend over the prefix and over themselves. The planner, the
layout, block forming and the runtime all ask this module what a batch shares, so they agree.
"""

from __future__ import annotations

from collections.abc import Sequence

# A batch shares a prefix only from this many tokens on. Below it the second attention pass over
# the prefix and the merge of the two cost about what the prefix's prefill saves
# (bench/prefix_threshold.py measures the crossing).
MIN_SHARED_PREFIX = 16


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def batch_groups(prompts: Sequence[Sequence[int]], keep: Sequence[int] | None = None,
                 minimum: int = MIN_SHARED_PREFIX) -> list[tuple[list[int], int]]:
    """The groups of one GPU batch's rows that each share a prefix: (rows, prefix length) pairs,
    each of two rows or more and a prefix of at least ``minimum`` ids that leaves every row its
    ``keep`` last ids (default 1). Rows in no group share nothing. The rows are cut, in the order of
    their ids, into the runs that save the most prefill tokens (a run of m rows sharing P saves
    (m - 1) * P), so that two subjects with a short preamble in common stay two groups; none where
    the batch, padded, would compute no fewer positions for it."""
    count = len(prompts)
    tails = keep if keep is not None else [1] * count
    order = sorted(range(count), key=lambda r: list(prompts[r]))
    room = [len(prompts[r]) - tails[r] for r in order]  # the longest prefix each row may share
    near = [common_prefix(prompts[a], prompts[b]) for a, b in zip(order, order[1:])]
    best = [0] * (count + 1)  # best[i]: the most saved over the first i rows of the order
    cut: list[tuple[int, int]] = [(0, 0)] * (count + 1)  # where best[i]'s last run starts, its prefix
    for stop in range(1, count + 1):
        best[stop], cut[stop] = best[stop - 1], (stop - 1, 0)  # row stop-1 alone
        shared = room[stop - 1]
        for start in range(stop - 2, -1, -1):  # the run order[start:stop]
            shared = min(shared, near[start], room[start])
            if shared < minimum:
                break
            saved = best[start] + (stop - start - 1) * shared
            if saved > best[stop]:
                best[stop], cut[stop] = saved, (start, shared)
    groups = []
    stop = count
    while stop > 0:
        start, shared = cut[stop]
        if shared:
            groups.append(([order[i] for i in range(start, stop)], shared))
        stop = start
    return groups[::-1] if _pays(prompts, groups) else []


def _pays(prompts: Sequence[Sequence[int]], groups: list[tuple[list[int], int]]) -> bool:
    """Whether the batch computes fewer prompt positions sharing: its rows are padded to the
    longest own part, and each prefix row to the longest prefix."""
    if not groups:
        return False
    shared = [0] * len(prompts)
    for rows, length in groups:
        for r in rows:
            shared[r] = length
    own = max(len(p) - n for p, n in zip(prompts, shared))
    longest = max(length for _, length in groups)
    return len(groups) * longest + len(prompts) * own < len(prompts) * max(map(len, prompts))


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """``common_prefix(a, b)`` by bisection over slices, which compare in C: a job's prompts are
    many and long."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _sorted_neighbours(prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int], list[int]]:
    """The prompts as lists, their sorted order, and the common length of each neighbour pair in it."""
    ids = [p if isinstance(p, list) else list(p) for p in prompts]
    order = sorted(range(len(ids)), key=ids.__getitem__)
    return ids, order, [_common_length(ids[a], ids[b]) for a, b in zip(order, order[1:])]


def prompt_shares(prompts: Sequence[Sequence[int]], keep: Sequence[int] | None = None,
                  minimum: int = MIN_SHARED_PREFIX) -> list[int]:
    """Per prompt, the longest prefix it shares with any other prompt of the job, leaving it at
    least ``keep[r]`` (default 1) of its own last ids as ``batch_groups`` does; 0 below ``minimum``.
    In the prompts' sorted order the longest prefix a prompt shares with any other is the one it
    shares with a neighbour, so the job is sorted once and each neighbour pair compared once."""
    ids, order, between = _sorted_neighbours(prompts)
    tails = keep if keep is not None else [1] * len(ids)
    shares = [0] * len(ids)
    for place, index in enumerate(order):
        best = max(between[place - 1] if place > 0 else 0, between[place] if place < len(between) else 0)
        best = min(best, len(ids[index]) - tails[index])
        shares[index] = best if best >= minimum else 0
    return shares


def job_shared_prefix(prompts: Sequence[Sequence[int]], keep: Sequence[int] | None = None,
                      minimum: int = MIN_SHARED_PREFIX) -> int:
    """The prefix a planner plans a job's GPU batches to share (``planner.Workload.shared_prefix``).
    The planner pads every row to the job's longest prompt, a prefix row holding the shared prefix
    and each row the rest; the runtime pads a batch's prefix rows to its longest prefix and its rows
    to their longest own part. So the plan's own part is the longest own part of the prompts that
    share (what follows a prompt's ``prompt_shares``), and its prefix what the longest prompt leaves
    beside it, no longer than the longest share: contexts of many lengths, each with four short
    choices, plan as long prefixes and short rows, not as their mean prefix beside rows padded to
    the longest context. Then scaled by the share of the prompts that share anything (a batch that
    mixes in prompts sharing nothing shares less), rounded down, and 0 below ``minimum``. A job of
    one prompt, or whose prompts share nothing, plans with 0."""
    if not prompts:
        return 0
    sharing = [(len(p), n) for p, n in zip(prompts, prompt_shares(prompts, keep, minimum)) if n]
    if not sharing:
        return 0
    own = max(length - n for length, n in sharing)
    prefix = min(max(n for _, n in sharing), max(map(len, prompts)) - own)
    planned = prefix * len(sharing) // len(prompts)
    return planned if planned >= minimum else 0


def job_prefix_group(prompts: Sequence[Sequence[int]], keep: Sequence[int] | None = None,
                     minimum: int = MIN_SHARED_PREFIX) -> int:
    """How many prompts share each prefix, which a planner plans a GPU batch's groups of rows with
    (``planner.Workload.prefix_group``): in the prompts' sorted order, the runs of neighbours that
    share at least ``minimum`` ids (leaving each its ``keep`` last ids), their mean size over the
    prompts in them (a run of m prompts counted m times), rounded down; 0 where none shares. Two
    neighbours sharing less than half what either shares with its other neighbour end a run, as
    ``batch_groups`` would cut them: two subjects whose few-shot examples begin with one preamble
    are two groups, not one."""
    ids, order, between = _sorted_neighbours(prompts)
    tails = keep if keep is not None else [1] * len(ids)
    room = [len(ids[r]) - tails[r] for r in order]  # the longest prefix each may share, in sorted order
    links = [min(common, room[i], room[i + 1]) for i, common in enumerate(between)]
    best = [max(links[i - 1] if i > 0 else 0, links[i] if i < len(links) else 0) for i in range(len(ids))]
    runs, size = [], 1
    for place, link in enumerate(links):
        if link >= minimum and 2 * link >= min(best[place], best[place + 1]):
            size += 1
            continue
        runs.append(size)
        size = 1
    runs.append(size)
    grouped = [m for m in runs if m > 1]
    return sum(m * m for m in grouped) // sum(grouped) if grouped else 0
