"""Length-aware block formation: which prompts run together in one block."""

from collections.abc import Sequence


def form_blocks(prompt_lens: Sequence[int], max_new_tokens: Sequence[int], block_size: int) -> list[list[int]]:
    """Group prompt indices into blocks of at most ``block_size``.

    Sorting on (prompt length, generation length) keeps the members of a block alike, so little
    is spent on left padding or on steps after a short member has finished.
    """
    order = sorted(range(len(prompt_lens)), key=lambda i: (prompt_lens[i], max_new_tokens[i], i))
    return [order[start:start + block_size] for start in range(0, len(order), block_size)]
