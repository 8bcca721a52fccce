"""Scenario definitions: data checks, HELM's prompt format, example choice, fitting, generated data."""

import pytest

from flexoff.harness.errors import ScenarioError
from flexoff.harness.scenarios import (SCENARIOS, SYNTHETIC_SPLITS, Instance, build_prompt, choose_examples,
                                       default_subject, fit_prompt, get_scenario, load_instances,
                                       reference_continuation)
from flexoff.harness.synthetic import pattern_match_problems

from .conftest import DATA, write_jsonl


def test_ships_the_five_table_9_scenarios():
    assert set(SCENARIOS) == {"wikifact", "mmlu", "synthetic_reasoning", "synthetic_reasoning_natural", "xsum"}


def test_unknown_scenario_lists_the_known_ones():
    with pytest.raises(ScenarioError, match="unknown scenario 'helm'; known scenarios: wikifact, mmlu"):
        get_scenario("helm")


@pytest.mark.parametrize("name, file", [("wikifact", "wikifact.jsonl"), ("mmlu", "abstract_algebra_test.jsonl"),
                                        ("synthetic_reasoning_natural", "synthetic_reasoning_natural.jsonl"),
                                        ("xsum", "xsum.jsonl")])
def test_fixture_data_loads(name, file):
    instances = load_instances(get_scenario(name), DATA / file)
    assert any(i.split == "train" for i in instances) and any(i.split == "test" for i in instances)
    assert all(i.references for i in instances)


@pytest.mark.parametrize("scenario, row, message", [
    ("xsum", {"id": "a", "references": ["s"]}, r"line 2: missing or empty field 'input'"),
    ("xsum", {"input": "article"}, r"line 2: field 'references' must list at least one"),
    ("xsum", {"input": "article", "references": [""]}, r"line 2: field 'references'"),
    ("xsum", {"input": "article", "reference": "s", "split": "dev"}, r"line 2: field 'split' must be"),
    ("xsum", {"input": "article", "reference": "s", "label": 1}, r"line 2: unknown field 'label'"),
    ("xsum", {"id": "x", "input": "article", "reference": "s"}, r"line 2: duplicate id 'x' \(first on line 1\)"),
    ("mmlu", {"input": "q", "answer": "A"}, r"line 2: field 'choices' must list 2 to 26"),
    ("mmlu", {"input": "q", "choices": ["a", "b"]}, r"line 2: missing field 'answer'"),
    ("mmlu", {"input": "q", "choices": ["a", "b"], "answer": "C"}, r"line 2: field 'answer' must be a choice index"),
    ("mmlu", {"input": "q", "choices": ["a", "b"], "answer": 2}, r"line 2: field 'answer'"),
])
def test_bad_data_names_line_and_field(tmp_path, scenario, row, message):
    first = {"id": "x", "input": "q", "choices": ["a", "b"], "answer": 0} if scenario == "mmlu" else \
        {"id": "x", "input": "first", "reference": "r"}
    path = write_jsonl(tmp_path / "data.jsonl", [first, row])
    with pytest.raises(ScenarioError, match=message):
        load_instances(get_scenario(scenario), path)


def test_data_needs_instances_to_evaluate_and_a_file(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"input": "a", "reference": "b", "split": "train"}])
    with pytest.raises(ScenarioError, match="no instances to evaluate"):
        load_instances(get_scenario("xsum"), path)
    with pytest.raises(ScenarioError, match="pass --data FILE"):
        load_instances(get_scenario("xsum"), None)
    with pytest.raises(ScenarioError, match="line 1: not valid JSON"):
        load_instances(get_scenario("xsum"), write_jsonl(tmp_path / "bad.jsonl", ["{oops"]))


def test_mmlu_prompt_is_helms_joint_multiple_choice_format():
    mmlu = get_scenario("mmlu")
    examples = [Instance(1, "What is 1 + 1?", ("B",), "train", ("1", "2")),
                Instance(2, "Is 0 even?", ("A",), "train", ("yes", "no"))]
    instance = Instance(3, "What is 2 * 3?", ("C",), "test", ("5", "7", "6"))
    expected = (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Question: What is 1 + 1?\nA. 1\nB. 2\nAnswer: B\n\n"
        "Question: Is 0 even?\nA. yes\nB. no\nAnswer: A\n\n"
        "Question: What is 2 * 3?\nA. 5\nB. 7\nC. 6\nAnswer:"
    )
    assert build_prompt(mmlu, examples, instance, subject="abstract algebra") == expected
    assert reference_continuation(mmlu, "C") == " C"


def test_other_templates():
    xsum, srn, sr, wiki = (get_scenario(n) for n in ("xsum", "synthetic_reasoning_natural", "synthetic_reasoning",
                                                    "wikifact"))
    article = Instance("a", "Rain fell.", ("It rained.",))
    assert build_prompt(xsum, [article], Instance("b", "Sun shone.", ("s",))) == (
        "###\nArticle: Rain fell.\n\nSummarize the above article in 1 sentence.\nIt rained.\n\n"
        "###\nArticle: Sun shone.\n\nSummarize the above article in 1 sentence.")
    assert reference_continuation(xsum, "It rained.") == "\nIt rained."
    assert build_prompt(srn, [], Instance("c", "If a cat is red, then the cat is big.", ("x",))) == (
        "Please solve the following problem.\n\nRules:\nIf a cat is red, then the cat is big.\n")
    assert build_prompt(sr, [], Instance("d", "Rules: X | Y | Result: kiwi", ("X",))) == (
        "Please solve the following problem.\n\nRules: X | Y | Result: kiwi\nTarget:")
    assert build_prompt(wiki, [Instance("e", "Mars is an instance of", ("planet",))],
                        Instance("f", "K2 is an instance of", ("mountain",))) == (
        "Mars is an instance of planet\n\nK2 is an instance of")


def test_examples_cover_the_common_answers_first_and_follow_the_seed():
    train = [Instance(i, f"q{i}", (answer,), "train") for i, answer in enumerate("AAAABBC")]
    chosen = choose_examples(list(train), 3, seed=0)
    assert sorted(e.references[0] for e in chosen) == ["A", "B", "C"]
    assert chosen[0].references[0] == "A"  # the most common answer leads
    assert choose_examples(list(train), 3, seed=0) == chosen
    assert len({tuple(e.id for e in choose_examples(list(train), 5, seed=s)) for s in range(6)}) > 1
    assert len(choose_examples(list(train), 20, seed=1)) == len(train)


class CharTokenizer:
    """One token per character, after a BOS of 0."""

    def encode(self, text):
        return [0] + [ord(c) for c in text]


def test_fit_drops_examples_then_truncates_keeping_the_end():
    wiki = get_scenario("wikifact")  # 8 new tokens
    examples = [Instance(i, "x" * 30, ("y",), "train") for i in range(3)]
    instance = Instance("t", "Mars is an instance of", ("planet",))
    whole = fit_prompt(wiki, examples, instance, CharTokenizer(), 1000)
    assert (whole.num_in_context, whole.truncated) == (3, False)
    fitted = fit_prompt(wiki, examples, instance, CharTokenizer(), 8 + 70)
    assert fitted.num_in_context == 1 and fitted.prompt_tokens + 8 <= 78
    cut = fit_prompt(wiki, examples, instance, CharTokenizer(), 8 + 10, bos_token_id=0)
    assert cut.truncated and cut.prompt == [0] + [ord(c) for c in "stance of"]


def test_mmlu_subject_comes_from_the_file_name():
    assert default_subject("data/us_foreign_policy_test.jsonl") == "us foreign policy"


def test_pattern_match_data_is_seeded_and_well_formed():
    problems = pattern_match_problems(42, 50)
    assert problems == pattern_match_problems(42, 50)
    assert problems[:10] == pattern_match_problems(42, 10)  # problem i does not depend on the count
    assert problems != pattern_match_problems(43, 50)
    for text, target in problems:
        rules, result = text.removeprefix("Rules: ").rsplit(" | Result: ", 1)
        candidates = rules.split(" | ")
        assert len(candidates) == 4 and target in candidates
        # Substituting words back for symbols in the target rebuilds the result.
        pattern, words = target.split(" "), result.split(" ")
        assert len(words) >= len(pattern)
        assert [t for t in pattern if t in "+-*="] == [w for w in words if w in "+-*="]


def test_generated_scenario_needs_no_file():
    instances = load_instances(get_scenario("synthetic_reasoning"), None, seed=1)
    # HELM's splits, whatever the seed; --max-instances subsamples them as HELM does
    assert [sum(i.split == split for i in instances) for split, _ in SYNTHETIC_SPLITS] == [1000, 5000, 5000]
    assert instances != load_instances(get_scenario("synthetic_reasoning"), None, seed=0)
