"""Accuracy metrics of the HELM-style scenarios, with HELM's definitions.

Each metric compares one reference with one prediction and returns a float in [0, 1]. An
instance's score is the maximum over its references and its sampled predictions (HELM's
"best of k"). Predictions are stripped of surrounding whitespace first, as HELM does.

- ``exact_match``: the stripped texts are equal.
- ``quasi_exact_match``: equal after normalising: lower case, punctuation and the articles
  a/an/the removed, whitespace collapsed.
- ``f1``: HELM's word-overlap F1 over the *sets* of normalised words.
- ``rouge_l``: ROUGE-L F-measure with Porter stemming, from the ``rouge-score`` package.
- ``f1_set_match``, ``iou_set_match``, ``exact_set_match``: for synthetic_reasoning_natural,
  whose answers read "The cow is purple and big." or "Nothing."; they compare the sets of
  attributes after the last " is ".
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence
from functools import lru_cache

from ..errors import FlexoffError

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_text(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD / HELM normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(gold: str, pred: str) -> float:
    if not pred:
        return 0.0
    return float(gold.strip() == pred.strip())


def quasi_exact_match(gold: str, pred: str) -> float:
    if not pred:
        return 0.0
    return float(normalize_text(gold) == normalize_text(pred))


def f1(gold: str, pred: str) -> float:
    gold_words, pred_words = set(normalize_text(gold).split()), set(normalize_text(pred).split())
    common = len(gold_words & pred_words)
    if not gold_words or not pred_words or not common:
        return 0.0
    precision, recall = common / len(pred_words), common / len(gold_words)
    return 2 * precision * recall / (precision + recall)


@lru_cache(maxsize=1)
def _rouge_scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise FlexoffError("the rouge_l metric needs the rouge-score package: pip install 'flexoff[harness]'") from None
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(gold: str, pred: str) -> float:
    return float(_rouge_scorer().score(gold, pred)["rougeL"].fmeasure)


def _attribute_set(text: str) -> set[str]:
    if text == "Nothing.":
        return set()
    return set(text.replace(".", "").split(" is ")[-1].split(" and "))


def _sets(gold: str, pred: str) -> tuple[set[str], set[str]]:
    # Only the first line of a prediction counts: the answer is one sentence.
    return _attribute_set(gold), _attribute_set(pred.split("\n")[0])


def f1_set_match(gold: str, pred: str) -> float:
    gold_set, pred_set = _sets(gold, pred)
    if not gold_set:
        return float(gold_set == pred_set)
    return 2 * len(gold_set & pred_set) / (len(gold_set) + len(pred_set))


def iou_set_match(gold: str, pred: str) -> float:
    gold_set, pred_set = _sets(gold, pred)
    if not gold_set:
        return float(gold_set == pred_set)
    return len(gold_set & pred_set) / len(gold_set | pred_set)


def exact_set_match(gold: str, pred: str) -> float:
    gold_set, pred_set = _sets(gold, pred)
    return float(gold_set == pred_set)


METRICS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "quasi_exact_match": quasi_exact_match,
    "f1": f1,
    "rouge_l": rouge_l,
    "f1_set_match": f1_set_match,
    "iou_set_match": iou_set_match,
    "exact_set_match": exact_set_match,
}


def best_score(metric: str, references: Sequence[str], predictions: Sequence[str]) -> float:
    """The instance's score: the best pairing of a reference with a (stripped) prediction."""
    function = METRICS[metric]
    preds = [(p or "").strip() for p in predictions] or [""]
    return max(function(gold, pred) for gold in references for pred in preds)
