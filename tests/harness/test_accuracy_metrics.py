"""Metric values on hand-made cases, worked out by hand."""

import pytest

from flexoff.harness.accuracy import (best_score, exact_match, exact_set_match, f1, f1_set_match, iou_set_match,
                                     normalize_text, quasi_exact_match, rouge_l)


def test_normalize_text():
    assert normalize_text("  The Cat, sat on A mat!  ") == "cat sat on mat"


@pytest.mark.parametrize("gold, pred, exact, quasi", [
    ("Paris", " Paris\n", 1.0, 1.0),
    ("Paris", "paris", 0.0, 1.0),
    ("the Eiffel Tower", "Eiffel tower.", 0.0, 1.0),
    ("Paris", "Lyon", 0.0, 0.0),
    ("Paris", "", 0.0, 0.0),
])
def test_exact_and_quasi_exact_match(gold, pred, exact, quasi):
    assert exact_match(gold, pred) == exact
    assert quasi_exact_match(gold, pred) == quasi


@pytest.mark.parametrize("gold, pred, expected", [
    ("the cat sat on the mat", "a cat sat", 2 / 3),  # precision 2/2, recall 2/4
    ("cat cat dog", "cat", 2 / 3),  # words count once: {cat, dog} against {cat}
    ("red blue", "green", 0.0),
    ("red", "", 0.0),
    ("New York City", "new york city", 1.0),
])
def test_f1(gold, pred, expected):
    assert f1(gold, pred) == pytest.approx(expected)


@pytest.mark.parametrize("gold, pred, expected", [
    ("the cat sat on the mat", "the cat on the mat", 10 / 11),  # LCS 5; P = 5/5, R = 5/6
    ("running dogs", "run dog", 1.0),  # Porter stemming
    ("a b c d", "d c b a", 0.25),  # LCS 1 of 4 each way
    ("summary", "", 0.0),
])
def test_rouge_l(gold, pred, expected):
    pytest.importorskip("rouge_score")
    assert rouge_l(gold, pred) == pytest.approx(expected)


@pytest.mark.parametrize("gold, pred, f1_value, iou, exact", [
    ("The cow is purple and big.", "The cow is big.", 2 / 3, 1 / 2, 0.0),
    ("The cow is purple and big.", "The cow is big and purple.\nThe end", 1.0, 1.0, 1.0),
    ("The cow is purple.", "The cow is red and cold.", 0.0, 0.0, 0.0),
    ("Nothing.", "Nothing.", 1.0, 1.0, 1.0),
    ("Nothing.", "The cow is red.", 0.0, 0.0, 0.0),
])
def test_set_matches(gold, pred, f1_value, iou, exact):
    assert f1_set_match(gold, pred) == pytest.approx(f1_value)
    assert iou_set_match(gold, pred) == pytest.approx(iou)
    assert exact_set_match(gold, pred) == exact


def test_best_score_takes_the_best_reference_and_sample():
    references, predictions = ["river", "stream"], [" lake", "Stream "]
    assert best_score("exact_match", references, predictions) == 0.0
    assert best_score("quasi_exact_match", references, predictions) == 1.0
    assert best_score("exact_match", ["B"], [" B"]) == 1.0
    assert best_score("exact_match", ["B"], []) == 0.0
