"""Length-aware block formation: which prompts run together in one block.

A block is left-padded to its longest prompt and runs until its members are done, so a member
shorter than the longest prompt, or with a smaller generation budget than the largest, costs
padding (FlexGen's Table 25 counts both). We keep the number of blocks at ``ceil(n / block_size)``
(each block is one pass of weight loading, the dominant cost when weights are offloaded) and,
within that budget, choose the grouping that minimises padded tokens:

1. Candidate partitions: "strips" of the prompts sorted by prompt length, each strip holding a
   whole number of blocks and cut into blocks after sorting it by generation length (and the
   same with the two lengths swapped). One strip per block is plain sorting by prompt length;
   one strip overall is plain sorting by generation length. The cheapest candidate wins.
2. Refinement: pairs of blocks that sit next to each other (by longest prompt or by largest
   budget) are pooled and re-split at the cheapest cut, under a fixed work budget.

The engine splits each block into GPU batches of consecutive members, and pads each GPU batch
separately; given ``gpu_batch_size``, each block's members are grouped the same way inside it.

Given the prompts' token ids, rows that share a long prefix are put in one GPU batch, which runs
that prefix once (:mod:`flexoff.runtime.prefix_forming`). A GPU batch then costs
``P + rows * (longest own prompt part + largest budget)`` for the ``P`` tokens its rows share, and
the grouping by prefix is kept only where that total is below the grouping by length: a job whose
prompts share nothing gets the blocks it would get without them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .prefix_forming import PrefixIndex, carve

# At most this many pair re-splits per partition: about a second on one core for large jobs.
_REFINE_BUDGET = 6000
_REFINE_WINDOW = 3
_REFINE_PASSES = 4
# Depths of the prefix tree from which the job is formed by prefix, each twice the last, at most this many.
_THRESHOLDS = 6


def form_blocks(prompt_lens: Sequence[int], max_new_tokens: Sequence[int], block_size: int,
                *, gpu_batch_size: int | None = None, prompts: Sequence[Sequence[int]] | None = None,
                keep: Sequence[int] | None = None, budget_weight: int = 1) -> list[list[int]]:
    """Group prompt indices into at most ``ceil(n / block_size)`` blocks of at most ``block_size``.

    Returns every index exactly once. Blocks come in ascending order of their longest prompt;
    inside a block, members come in GPU-batch groups when ``gpu_batch_size`` is given.
    ``prompts``: each prompt's token ids, to put rows sharing a prefix in one GPU batch; ``keep``:
    how many of each prompt's last positions the head reads, never shared (default 1 each; see
    ``flexoff.prefixes.batch_groups``). ``budget_weight``: what a generated token costs in prompt
    tokens (1 counts padding as FlexGen does; a planned policy's prediction gives the time each
    costs, ``Prediction.generated_token_weight``).
    """
    _check(prompt_lens, max_new_tokens, block_size, gpu_batch_size, prompts, keep)
    if not isinstance(budget_weight, int) or budget_weight < 1:
        raise ValueError(f"budget_weight must be an integer >= 1, got {budget_weight!r}")
    if len(prompt_lens) == 0:
        return []
    p = np.asarray(prompt_lens, dtype=np.int64)
    # Every cost below counts p + g per row: budgets in prompt tokens' worth weigh them so.
    g = np.asarray(max_new_tokens, dtype=np.int64) * budget_weight
    blocks = _ordered(_partition(p, g, np.arange(len(p)), block_size), p, g)
    if gpu_batch_size is not None and gpu_batch_size < block_size:
        blocks = [np.concatenate(_ordered(_partition(p, g, block, gpu_batch_size), p, g)) for block in blocks]
    if prompts is not None:
        blocks = _by_prefix(blocks, p, g, block_size, _batch(gpu_batch_size, block_size), PrefixIndex(prompts, keep))
    return [block.tolist() for block in blocks]


def _check(prompt_lens, max_new_tokens, block_size, gpu_batch_size, prompts, keep) -> None:
    if len(prompt_lens) != len(max_new_tokens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(max_new_tokens)} generation budgets")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if gpu_batch_size is not None and not (isinstance(gpu_batch_size, int) and gpu_batch_size >= 1):
        raise ValueError(f"gpu_batch_size must be an integer >= 1, got {gpu_batch_size!r}")
    if prompts is None:
        if keep is not None:
            raise ValueError("keep counts prompt positions: give the prompts too")
        return
    if len(prompts) != len(prompt_lens) or any(len(ids) != n for ids, n in zip(prompts, prompt_lens)):
        raise ValueError("prompts must be the token ids of each prompt, as long as its prompt length")
    if keep is not None and len(keep) != len(prompts):
        raise ValueError(f"{len(keep)} keep counts for {len(prompts)} prompts")


def _batch(gpu_batch_size: int | None, block_size: int) -> int:
    return block_size if gpu_batch_size is None else min(gpu_batch_size, block_size)


def padded_tokens(blocks: Sequence[Sequence[int]], prompt_lens: Sequence[int], max_new_tokens: Sequence[int],
                  *, gpu_batch_size: int | None = None, prompts: Sequence[Sequence[int]] | None = None,
                  keep: Sequence[int] | None = None) -> int:
    """Tokens a grouping costs when every member is padded to its group's longest prompt and budget:
    a group is a block, or with ``gpu_batch_size`` each GPU batch of it; with ``prompts`` (and
    ``keep``, as ``form_blocks`` takes them), a GPU batch's shared prefix counts once."""
    p = np.asarray(prompt_lens, dtype=np.int64)
    g = np.asarray(max_new_tokens, dtype=np.int64)
    index = PrefixIndex(prompts, keep) if prompts is not None else None
    size = max((len(b) for b in blocks), default=1)
    arrays = [np.asarray(b, dtype=np.int64) for b in blocks if len(b)]
    return _shared_cost(arrays, p, g, _batch(gpu_batch_size, size), index)


def _shared_cost(blocks: list[np.ndarray], p: np.ndarray, g: np.ndarray, batch: int,
                 index: PrefixIndex | None) -> int:
    """Padded tokens of the blocks' GPU batches of ``batch`` consecutive members, each batch's
    shared prefixes counted once."""
    total = 0
    for block in blocks:
        for start in range(0, len(block), batch):
            rows = block[start:start + batch]
            total += index.batch_cost(rows, p, g) if index is not None else _cost(rows, p, g)
    return total


def _by_prefix(blocks: list[np.ndarray], p: np.ndarray, g: np.ndarray, size: int, batch: int,
               index: PrefixIndex) -> list[np.ndarray]:
    """The cheapest, counting shared prefixes once, of ``blocks`` (the grouping by length), those
    blocks with their GPU batches formed by prefix, the rows sharing a prefix side by side (their
    runs in the order of their ids, or of their length), and the whole job formed by prefix
    (carving nodes of the prefix tree from a few depths up); ``blocks`` where nothing is cheaper."""
    items = np.arange(len(p))
    depths = index.depths(items)
    if not depths or size % batch:  # nothing shared; or GPU batches that do not tile a block
        return blocks
    candidates = [blocks, [_cheaper_inside(block, p, g, batch, index) for block in blocks]]
    for runs in (index.runs(items, p, g), index.runs(items, p, g, by_length=True)):
        candidates.append([runs[i:i + size] for i in range(0, len(runs), size)])
    thresholds: list[int] = []
    for depth in depths:  # deeper thresholds leave shallow prefixes to the grouping by length
        if len(thresholds) < _THRESHOLDS and (not thresholds or depth >= 2 * thresholds[-1]):
            thresholds.append(depth)
    for threshold in thresholds:
        batches = _prefix_batches(items, p, g, batch, index, threshold)
        per_block = size // batch
        grouped = [np.concatenate(batches[i:i + per_block]) for i in range(0, len(batches), per_block)]
        candidates.append(sorted(grouped, key=lambda b: (int(p[b].max()), int(g[b].max()), int(b[0]))))
    costs = [_shared_cost(c, p, g, batch, index) for c in candidates]
    return candidates[int(np.argmin(costs))]  # the first of equals: the grouping by length


def _cheaper_inside(block: np.ndarray, p: np.ndarray, g: np.ndarray, batch: int, index: PrefixIndex) -> np.ndarray:
    """The block's members with their GPU batches formed by prefix, where that costs less."""
    if len(block) <= 1:
        return block
    formed = np.concatenate(_prefix_batches(block, p, g, batch, index, 0))
    cost = lambda b: _shared_cost([b], p, g, batch, index)  # noqa: E731
    return formed if cost(formed) < cost(block) else block


def _prefix_batches(items: np.ndarray, p: np.ndarray, g: np.ndarray, batch: int, index: PrefixIndex,
                    threshold: int) -> list[np.ndarray]:
    """``items`` in GPU batches: full ones carved from the prefix tree, the rest grouped by length
    and budget into full ones and at most one short one, which comes last (only a block's last
    GPU batch may be short)."""
    carved, rest = carve(index, p, g, items, batch, threshold)
    formed = carved + (_best_strips(p, g, rest, batch) if len(rest) else [])
    formed = [b[np.lexsort((b, g[b], p[b]))] for b in formed]
    key = lambda b: (len(b) < batch, int(p[b].max()), int(g[b].max()), int(b[0]))  # noqa: E731
    return sorted(formed, key=key)


def _cost(block: np.ndarray, p: np.ndarray, g: np.ndarray) -> int:
    return len(block) * int(p[block].max() + g[block].max())


def _ordered(blocks: list[np.ndarray], p: np.ndarray, g: np.ndarray) -> list[np.ndarray]:
    """Members by (prompt, budget, index) and blocks by their first member: deterministic output."""
    inner = [b[np.lexsort((b, g[b], p[b]))] for b in blocks if len(b)]
    return sorted(inner, key=lambda b: (int(p[b].max()), int(g[b].max()), int(b[0])))


def _partition(p: np.ndarray, g: np.ndarray, items: np.ndarray, size: int) -> list[np.ndarray]:
    if -(-len(items) // size) == 1:
        return [items]
    return _refine(_best_strips(p, g, items, size), p, g, size)


def _best_strips(p: np.ndarray, g: np.ndarray, items: np.ndarray, size: int) -> list[np.ndarray]:
    """The cheapest of the strip partitions (see the module's docstring): groups of ``size``, but
    for the last one."""
    count = len(items)
    num_blocks = -(-count // size)
    if num_blocks == 1:
        return [items]
    by_prompt = items[np.lexsort((items, g[items], p[items]))]
    by_budget = items[np.lexsort((items, p[items], g[items]))]
    strip_counts = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, num_blocks}
    strip_counts |= {max(1, num_blocks // k) for k in (2, 3, 4, 6, 8)}
    best, best_cost = None, None
    for strips in sorted(s for s in strip_counts if s <= num_blocks):
        for primary, secondary in ((by_prompt, g), (by_budget, p)):
            candidate = _strips(primary, secondary, p, size, num_blocks, strips)
            cost = sum(_cost(b, p, g) for b in candidate)
            if best_cost is None or cost < best_cost:
                best, best_cost = candidate, cost
    return best


def _strips(primary: np.ndarray, secondary: np.ndarray, tie: np.ndarray, size: int, num_blocks: int,
            strips: int) -> list[np.ndarray]:
    """Cut ``primary`` (sorted on one length) into ``strips`` runs of whole blocks, sort each run on
    the other length, and chunk it into blocks."""
    blocks = []
    base, extra = divmod(num_blocks, strips)
    start = 0
    for s in range(strips):
        run = primary[start:start + (base + (s < extra)) * size]
        start += len(run)
        run = run[np.lexsort((run, tie[run], secondary[run]))]
        blocks.extend(run[i:i + size] for i in range(0, len(run), size))
    return [b for b in blocks if len(b)]


def _best_split(pool: np.ndarray, p: np.ndarray, g: np.ndarray, size: int):
    """The cheapest cut of ``pool`` into two groups of at most ``size`` (one may be empty), trying
    the orders by prompt length, by budget and by their sum. Returns (cost, left, right)."""
    m = len(pool)
    lo, hi = max(0, m - size), min(size, m)
    best = None
    cuts = np.arange(lo, hi + 1)
    for key in (p[pool], g[pool], p[pool] + g[pool]):
        order = pool[np.lexsort((pool, key))]
        pp, gg = p[order], g[order]
        # Prefix maxima cover [0, k); suffix maxima cover [k, m). Index 0 / m stands for "empty".
        pre = np.concatenate(([0], np.maximum.accumulate(pp)))
        pre_g = np.concatenate(([0], np.maximum.accumulate(gg)))
        suf = np.concatenate((np.maximum.accumulate(pp[::-1])[::-1], [0]))
        suf_g = np.concatenate((np.maximum.accumulate(gg[::-1])[::-1], [0]))
        costs = cuts * (pre[cuts] + pre_g[cuts]) + (m - cuts) * (suf[cuts] + suf_g[cuts])
        j = int(np.argmin(costs))
        if best is None or costs[j] < best[0]:
            best = (int(costs[j]), order[:cuts[j]], order[cuts[j]:])
    return best


def _refine(blocks: list[np.ndarray], p: np.ndarray, g: np.ndarray, size: int) -> list[np.ndarray]:
    blocks = list(blocks)
    budget = _REFINE_BUDGET
    by_prompt = lambda i: (int(p[blocks[i]].max()) if len(blocks[i]) else -1, i)  # noqa: E731
    by_budget = lambda i: (int(g[blocks[i]].max()) if len(blocks[i]) else -1, i)  # noqa: E731
    for _ in range(_REFINE_PASSES):
        improved = False
        for key in (by_prompt, by_budget):
            order = sorted(range(len(blocks)), key=key)
            for x, i in enumerate(order):
                for j in order[x + 1:x + 1 + _REFINE_WINDOW]:
                    if budget <= 0:
                        return [b for b in blocks if len(b)]
                    budget -= 1
                    a, b = blocks[i], blocks[j]
                    if not len(a) or not len(b):
                        continue
                    current = _cost(a, p, g) + _cost(b, p, g)
                    cost, left, right = _best_split(np.concatenate((a, b)), p, g, size)
                    if cost < current:
                        blocks[i], blocks[j] = left, right
                        improved = True
        if not improved:
            break
    return [b for b in blocks if len(b)]
