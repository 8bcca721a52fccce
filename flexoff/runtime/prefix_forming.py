"""Block forming by shared prompt prefixes: the prefix tree of a job's prompts, what a group of
rows shares, and GPU batches carved where rows share a long prefix.

A GPU batch whose rows begin alike runs that prefix once (``flexoff.prefixes.batch_groups``), so
it costs ``P + rows * (longest own prompt part + largest budget)`` padded tokens instead of
``rows * (longest prompt + largest budget)``. The prompts sorted by their token ids, with each
neighbour's common prefix, are the prefix tree: the rows sharing at least ``d`` tokens with one
another are a run of that order whose neighbour prefixes are all at least ``d``, and what any set of
rows shares is the least neighbour prefix between its first and last in that order.
:func:`carve` walks the tree bottom-up and cuts full GPU batches out of each node, deepest first;
what a node cannot fill goes up to its parent, and what the root holds is left to the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..prefixes import MIN_SHARED_PREFIX, batch_groups


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """``prefixes.common_prefix`` on arrays: the same count, without a Python loop per token."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixIndex:
    """The job's prompts in the order of their ids, with each neighbour's common prefix and a
    range-minimum table over them, so that what any rows share is two lookups."""

    def __init__(self, prompts: Sequence[Sequence[int]], keep: Sequence[int] | None = None):
        count = len(prompts)
        keep = [1] * count if keep is None else keep
        self.prompts, self.keep = prompts, keep
        self.order = np.array(sorted(range(count), key=lambda i: (list(prompts[i]), i)), dtype=np.int64)
        self.rank = np.empty(count, dtype=np.int64)
        self.rank[self.order] = np.arange(count)
        # The head reads row r's last keep[r] positions: they are its own, never shared.
        self.room = np.array([max(len(p) - k, 0) for p, k in zip(prompts, keep)], dtype=np.int64)
        arrays = [np.asarray(prompts[i], dtype=np.int64) for i in self.order]
        lcp = np.zeros(count, dtype=np.int64)  # lcp[j]: ranks j - 1 and j
        for j in range(1, count):
            lcp[j] = _common(arrays[j - 1], arrays[j])
        self.table = [lcp]
        width = 1
        while 2 * width < count:
            last = self.table[-1]
            self.table.append(np.minimum(last[:-width], last[width:]))
            width *= 2

    def between(self, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        """The common prefix of ranks ``low`` to ``high`` (each pair, ``low < high``)."""
        span = high - low  # neighbour prefixes low + 1 .. high
        level = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
        out = np.empty(len(low), dtype=np.int64)
        for lv in np.unique(level):
            at = level == lv
            row = self.table[lv]
            out[at] = np.minimum(row[low[at] + 1], row[high[at] - (1 << lv) + 1])
        return out

    def batch_cost(self, rows: np.ndarray, p: np.ndarray, g: np.ndarray) -> int:
        """Padded tokens of one GPU batch of ``rows`` as the runtime runs it: each group of rows
        sharing a prefix (``prefixes.batch_groups``) holds it once, in a row as long as the
        longest, and every row its own part and the largest budget."""
        groups = batch_groups([self.prompts[r] for r in rows], [self.keep[r] for r in rows])
        shared = np.zeros(len(rows), dtype=np.int64)
        for members, length in groups:
            shared[members] = length
        longest = max((length for _, length in groups), default=0)
        return len(groups) * longest + len(rows) * int((p[rows] - shared).max() + g[rows].max())

    def runs(self, items: np.ndarray, p: np.ndarray, g: np.ndarray, by_length: bool = False) -> np.ndarray:
        """``items`` with the rows that share a prefix side by side, each such run by prompt length
        and budget: cut into consecutive GPU batches, a batch then holds few prefixes. The runs come
        in the order of their ids, or ``by_length``, of their longest prompt and budget: a batch of
        many short runs (a context's four choices) then holds prefixes alike in length, which its
        prefix rows pad to the longest."""
        ordered, links = self.links(items)
        starts = np.flatnonzero(links < MIN_SHARED_PREFIX)
        runs = [r[np.lexsort((r, g[r], p[r]))] for r in np.split(ordered, starts[1:])]
        if by_length:
            runs.sort(key=lambda r: (int(p[r].max()), int(g[r].max()), int(r[0])))
        return np.concatenate(runs)

    def links(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``items`` in rank order, and what each shares with the one before it (0 for the first),
        counting only the prompt positions each may share."""
        ordered = items[np.argsort(self.rank[items], kind="stable")]
        ranks = self.rank[ordered]
        links = np.zeros(len(ordered), dtype=np.int64)
        if len(ordered) > 1:
            links[1:] = np.minimum(self.between(ranks[:-1], ranks[1:]),  # room >= 0, so links are too
                                   np.minimum(self.room[ordered[:-1]], self.room[ordered[1:]]))
        return ordered, links

    def depths(self, items: np.ndarray) -> list[int]:
        """The distinct depths (at least MIN_SHARED_PREFIX) at which some of ``items`` share a prefix."""
        _, links = self.links(items)
        return sorted({int(d) for d in links if d >= MIN_SHARED_PREFIX})


def carve(index: PrefixIndex, p: np.ndarray, g: np.ndarray, items: np.ndarray, size: int,
          threshold: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Full GPU batches of ``size`` rows cut from the prefix tree's nodes at least ``threshold``
    deep, deepest first, and the rows left over."""
    ordered, links = index.links(items)
    batches: list[np.ndarray] = []
    stack: list[tuple[int, list[int]]] = [(0, [])]  # (node depth, the rows it holds)

    def close_to(height: int) -> None:
        carry: list[int] = []
        while stack[-1][0] > height:
            node_depth, rows = stack.pop()
            carry = rows + carry  # a node holds its own rows and what its children left
            if node_depth >= max(threshold, MIN_SHARED_PREFIX) and len(carry) >= size:
                cut, left = _carve_node(np.array(carry, dtype=np.int64), node_depth, p, g, size)
                batches.extend(cut)
                carry = left.tolist()
        if stack[-1][0] < height:
            stack.append((height, carry))
        else:
            stack[-1][1].extend(carry)

    for row, link in zip(ordered.tolist(), links.tolist()):
        close_to(link)
        stack[-1][1].append(row)
        # The row is a leaf as deep as its own prompt: the next row's link may reach past this node.
        room = int(index.room[row])
        if room > stack[-1][0]:
            stack[-1][1].pop()
            stack.append((room, [row]))
    close_to(0)
    return batches, np.array(stack[0][1], dtype=np.int64)


def _carve_node(rows: np.ndarray, depth: int, p: np.ndarray, g: np.ndarray,
                size: int) -> tuple[list[np.ndarray], np.ndarray]:
    """As many full batches as ``rows`` (which share ``depth`` tokens) fill, and the rest: the rows
    in order of prompt length or of budget, cut into consecutive batches around one run of the
    rows left over, placed where the batches cost least."""
    count = len(rows)
    full, rest = divmod(count, size)
    best = None
    for order in (rows[np.lexsort((rows, g[rows], p[rows]))], rows[np.lexsort((rows, p[rows], g[rows]))]):
        pp, gg = p[order], g[order]
        windows = np.lib.stride_tricks.sliding_window_view
        cost = depth + size * (windows(pp, size).max(axis=1) - depth + windows(gg, size).max(axis=1))
        before = np.concatenate(([0], np.cumsum(cost[0:full * size:size])))  # batches ahead of the run
        after = np.concatenate((np.cumsum(cost[rest::size][:full][::-1])[::-1], [0]))  # and behind it
        own = np.concatenate(([0], np.cumsum(pp + gg)))
        starts = np.arange(full + 1) * size
        total = before + after + (own[starts + rest] - own[starts])  # the run costs at least its own tokens
        t = int(np.argmin(total))
        if best is None or total[t] < best[0]:
            best = (total[t], order, t)
    _, order, t = best
    start = t * size
    kept = np.concatenate((order[:start], order[start + rest:]))
    return [kept[i:i + size] for i in range(0, len(kept), size)], order[start:start + rest]
