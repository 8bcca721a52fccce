"""Checks of a batch job's input file: every problem names its line and field."""

import pytest

from flexoff.errors import FlexoffError, PromptError
from flexoff.harness.batch import read_batch_input

from .conftest import write_jsonl


def test_reads_every_field(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "hello"},
        "",
        {"id": 7, "prompt": [2, 5, 9], "max_new_tokens": 3, "stop": "\n", "meta": {"k": [1]}},
    ])
    lines, digest = read_batch_input(path)
    assert [(x.line, x.id, x.prompt) for x in lines] == [(1, "a", "hello"), (3, 7, [2, 5, 9])]
    assert lines[1].max_new_tokens == 3 and lines[1].stop == ("\n",) and lines[1].meta == {"k": [1]}
    assert lines[0].max_new_tokens is None and lines[0].stop == ()
    assert len(digest) == 64


@pytest.mark.parametrize("rows, message", [
    ([{"id": "a", "prompt": "x"}, '{"id": "b", "prompt": '], r"line 2: not valid JSON"),
    ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], r"line 2: duplicate id 'a' \(first on line 1\)"),
    ([{"id": "a", "prompt": "   "}], r"line 1: field 'prompt' is empty"),
    ([{"id": "a", "prompt": []}], r"line 1: field 'prompt' is an empty token list"),
    ([{"id": "a", "prompt": [1, -2]}], r"line 1: field 'prompt' must be text or a list of token ids"),
    ([{"prompt": "x"}], r"line 1: missing field 'id'"),
    ([{"id": "a"}], r"line 1: missing field 'prompt'"),
    ([{"id": True, "prompt": "x"}], r"line 1: field 'id' must be"),
    ([{"id": "a", "prompt": "x", "max_new_tokens": 0}], r"line 1: field 'max_new_tokens' must be an integer >= 1"),
    ([{"id": "a", "prompt": "x", "stop": [1]}], r"line 1: field 'stop' must be a string or a list"),
    ([{"id": "a", "prompt": "x", "max_tokens": 5}], r"line 1: unknown field 'max_tokens'.*meta"),
    (["[1, 2]"], r"line 1: expected a JSON object"),
    ([], r"has no prompts"),
])
def test_bad_input_names_the_line(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(PromptError, match=message) as info:
        read_batch_input(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": "\xff"}\n')
    with pytest.raises(PromptError, match="line 2: not valid UTF-8"):
        read_batch_input(path)


def test_missing_file(tmp_path):
    with pytest.raises(FlexoffError, match="cannot read input file"):
        read_batch_input(tmp_path / "nope.jsonl")
