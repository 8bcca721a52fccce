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


def batch_prefix(prompts: Sequence[Sequence[int]], keep: Sequence[int] | None = None,
                 minimum: int = MIN_SHARED_PREFIX) -> int:
    """The prefix the rows of one GPU batch share: their common leading ids, leaving row r at least
    ``keep[r]`` (default 1) of its own prompt's last ids, whose hidden states the head reads; 0 where
    that is shorter than ``minimum`` or the batch has one row."""
    if len(prompts) < 2:
        return 0
    first = prompts[0]
    shared = len(first)
    for other in prompts[1:]:
        shared = common_prefix(first[:shared], other)
        if shared < minimum:
            return 0
    tails = keep if keep is not None else [1] * len(prompts)
    shared = min(shared, min(len(p) - t for p, t in zip(prompts, tails)))
    return shared if shared >= minimum else 0


def batch_groups(prompts: Sequence[Sequence[int]], keep: Sequence[int] | None = None,
                 minimum: int = MIN_SHARED_PREFIX) -> list[tuple[list[int], int]]:
    """The groups of one GPU batch's rows that each share a prefix: (rows, prefix length) pairs,
    each of two rows or more and a prefix of at least ``minimum`` ids that leaves every row its
    ``keep`` last ids (default 1). Rows in no group share nothing. The rows are cut, in the order of
    their ids, into the runs that save the most prefill tokens (a run of m rows sharing P saves
    (m - 1) * P), so that two subjects with a short preamble in common stay two groups."""
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
    return groups[::-1]
