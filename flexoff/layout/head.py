"""The token sampler's device memory (runtime.sampler.BatchSampler), beyond the head's logits.

A policy is planned, and each block checked, before anything says which sampling parameters its
sequences take (the planner runs when the LLM is built; a block may mix parameters), so these are
the figures of the costliest path, every option on: penalties, min-p, top-k, top-p, min_tokens,
logprobs. A greedy job without penalties holds less (8 bytes per entry at a step and no state).
bench/sampler_step.py measures the real figures on a GPU.
"""

from __future__ import annotations

# Rows the sampler sorts at a time for top-k and top-p: a sort's outputs and scratch scale with it.
SORTED_ROWS = 16

# Bytes per (row, vocabulary entry) at a head step, on every row: an fp32 copy of the logits that
# penalties and warping change in place (4), the fp32 log-probabilities kept for the step's logprobs
# (4), and the largest phase's temporaries (6: the repetition penalty's fp32 factor and two masks;
# min-p's probabilities and mask take 5, the draw's probabilities and noise 4).
STEP_BYTES = 14
# Bytes per (row, vocabulary entry) for each row sorted at once: the sorted values and their int64
# order (12), and CUDA's segmented radix sort's scratch (32: two int2 index-and-segment buffers, a
# copy of the keys, and cub's alternate keys and values).
SORT_BYTES = 44
# Bytes per (row, vocabulary entry) kept for every row of a block from its prefill to its last
# token: int32 counts of each row's output tokens (frequency and presence penalties) and a bool
# mask of the tokens it has seen (repetition penalty). Stop ids for min_tokens are kept as ids.
STATE_BYTES = 5


def sampler_step_bytes(rows: int, vocab: int) -> int:
    """Device bytes one GPU batch of ``rows`` takes at its peak while its next tokens are chosen,
    beyond the head's logits; an upper bound (the sort's and the other phases' peaks are added)."""
    return vocab * (STEP_BYTES * rows + SORT_BYTES * min(rows, SORTED_ROWS))


def head_step_bytes(rows: int, vocab: int, itemsize: int) -> int:
    """Device bytes of one GPU batch's head step: the last position's logits in the compute dtype
    (``itemsize`` bytes an entry) and the sampler's work on them."""
    return rows * vocab * itemsize + sampler_step_bytes(rows, vocab)


def sampler_state_bytes(rows: int, vocab: int) -> int:
    """Device bytes the samplers of a block of ``rows`` sequences keep for the whole block."""
    return STATE_BYTES * rows * vocab


# Bytes per (position, vocabulary entry) where log-probabilities are made for many positions at once
# (prompt logprobs, scoring): the head's logits in the compute dtype (at most 4), an fp32 copy, the
# fp32 log-probabilities and a comparison mask for ranks (4 + 4 + 1).
LOGPROB_BYTES = 13


def logprob_positions(rows: int, vocab: int, itemsize: int) -> int:
    """Positions whose log-probabilities may be made at once, so that they take no more than what a
    head step of ``rows`` sequences is counted for (its logits and the sampler's work); at least one."""
    return max(1, head_step_bytes(rows, vocab, itemsize) // (LOGPROB_BYTES * vocab))
