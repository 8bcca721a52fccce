"""synthetic_reasoning (pattern_match) data, generated and seeded as HELM describes it.

Each problem hides a *pattern*: rule symbols (X, Y, Z, some repeated) and math symbols in a
random order, e.g. ``Y + Z = Y``. Substituting words for the symbols gives a *result*, e.g.
``lion grape + kiwi = lion grape``. The model sees the true pattern among three decoys (the same
symbols shuffled) and the result, and must name the pattern::

    Rules: Z = Y + Y | Y + Z = Y | Y = Y + Z | Z + Y = Y | Result: lion grape + kiwi = lion grape
    Target: Y + Z = Y

Generation is a pure function of the seed, and problem *i* is the same whatever the number asked
for. Seeded with 42 it is HELM's stream: its first 1000 problems are HELM's in-context pool, the
next 5000 its valid split and the last 5000 its test split (see ``scenarios.SYNTHETIC_SPLITS``).
"""

from __future__ import annotations

import numpy as np

ANIMALS = ["zebra", "cobra", "stork", "penguin", "shark", "lion", "buffalo", "whale", "seal", "eagle", "horse", "rat"]
FRUITS = ["apple", "peach", "watermelon", "banana", "grape", "kiwi", "pear", "strawberry", "blueberry", "blackberry"]
RULE_SYMBOLS = ["X", "Y", "Z"]
MATH_SYMBOLS = ["+", "-", "*", "="]
NUM_DECOYS = 3


def _substitution(rng: np.random.RandomState, symbols: list[str]) -> dict[str, str]:
    """One to two random words for each distinct rule symbol."""
    words = ANIMALS + FRUITS
    return {symbol: " ".join(rng.choice(words, size=rng.randint(1, 3))) for symbol in symbols}


def _shuffled(rng: np.random.RandomState, items: list[str]) -> list[str]:
    items = list(items)
    rng.shuffle(items)
    return items


def pattern_match_problems(seed: int, count: int) -> list[tuple[str, str]]:
    """The first ``count`` (input, target) problems of the stream seeded by ``seed``."""
    rng = np.random.RandomState(seed)
    problems = []
    for _ in range(count):
        rule = [str(s) for s in rng.choice(RULE_SYMBOLS, size=rng.randint(2, 4))]
        distinct = sorted(set(rule))
        math = [str(s) for s in rng.choice(MATH_SYMBOLS, size=rng.randint(2, 4))]
        pattern = _shuffled(rng, rule + math)
        substitution = _substitution(rng, distinct)
        _substitution(rng, distinct)  # HELM's induction mode draws a second one; keep the stream aligned
        result = " ".join(substitution.get(token, token) for token in pattern)
        target = " ".join(pattern)
        candidates = [" ".join(_shuffled(rng, distinct + math)) for _ in range(NUM_DECOYS)] + [target]
        candidates = _shuffled(rng, candidates)
        problems.append((f"Rules: {' | '.join(candidates)} | Result: {result}", target))
    return problems
