"""OpenAI batch bodies as OpenAI's own files hold them: fields at their default values and null are
accepted and change nothing, other values of those fields are refused by name, and every error
names the line and the custom_id."""

import pytest

from flexoff.commands.main import main
from flexoff.errors import PromptError
from flexoff.harness.openai_batch import read_request

from .conftest import write_jsonl
from .test_chat_jobs import CHATS
from .test_openai_batch import batch_args, chat, completion, responses

NEUTRAL_COMPLETION = {"stream": False, "echo": False, "logit_bias": {}, "best_of": 1, "n": 1, "suffix": None,
                      "logprobs": None, "user": "someone", "stream_options": None, "temperature": None,
                      "top_p": None, "presence_penalty": 0, "frequency_penalty": 0, "stop": None, "seed": None}
NEUTRAL_CHAT = {"stream": False, "logit_bias": None, "n": 1, "logprobs": False, "top_logprobs": None, "store": False,
                "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "response_format": {"type": "text"},
                "modalities": ["text"], "audio": None, "user": "someone", "max_completion_tokens": None}


def read(row, number=1):
    return read_request(row, f"in.jsonl line {number}", number)


def same_request(a, b) -> bool:
    """Two requests that run alike: the same line, kind and sampling parameters."""
    from flexoff import SamplingParams

    return (a.line, a.custom_id, a.kind) == (b.line, b.custom_id, b.kind) and \
        SamplingParams(**a.sampling) == SamplingParams(**b.sampling)


def test_fields_at_their_default_values_read_as_if_left_out():
    assert same_request(read(completion("a", "the cat", max_tokens=3, **NEUTRAL_COMPLETION)),
                        read(completion("a", "the cat", max_tokens=3)))
    assert same_request(read(chat("h", CHATS[0], max_tokens=3, **NEUTRAL_CHAT)),
                        read(chat("h", CHATS[0], max_tokens=3)))
    # best_of is neutral at n: every choice generated is returned.
    assert same_request(read(completion("a", "x", n=2, best_of=2)), read(completion("a", "x", n=2)))


def test_a_prompt_list_of_one_is_that_prompt_and_of_several_is_each_of_them():
    assert same_request(read(completion("a", ["the cat"])), read(completion("a", "the cat")))
    assert same_request(read(completion("a", [[5, 6, 7]])), read(completion("a", [5, 6, 7])))
    several = read(completion("a", ["the cat", [5, 6], "the dog"]))
    assert several.prompts == ("the cat", [5, 6], "the dog") and several.line.prompt == "the cat"


@pytest.mark.parametrize("row, says", [
    (completion("a", "x", stream=True), "body field 'stream' is not supported for /v1/completions except as false"),
    (completion("a", "x", echo=True), "body field 'echo' is not supported"),
    (completion("a", "x", logit_bias={"5": -100}), "body field 'logit_bias' is not supported"),
    (completion("a", "x", best_of=3), "body field 'best_of' must equal n"),
    (completion("a", "x", n=2, best_of=1), "body field 'best_of' must equal n"),
    (completion("a", "x", suffix="end"), "body field 'suffix' is not supported"),
    (completion("a", "x", stream=0), "body field 'stream' is not supported"),  # 0 is not false in JSON
    (chat("a", CHATS[0], tools=[{"type": "function", "function": {"name": "f"}}]), "body field 'tools'"),
    (chat("a", CHATS[0], response_format={"type": "json_object"}), "body field 'response_format'"),
    (chat("a", CHATS[0], echo=False), "body field 'echo' is not supported for /v1/chat/completions"),
    (completion("a", ["the cat", ""]), "body field 'prompt', prompt 1 is empty"),
])
def test_a_value_flexoff_cannot_honour_is_refused_naming_the_field_line_and_custom_id(row, says):
    with pytest.raises(PromptError, match=r"^in\.jsonl line 4 \(custom_id 'a'\): ") as refused:
        read(row, 4)
    assert says in str(refused.value)


def test_an_error_after_the_custom_id_is_read_names_it():
    with pytest.raises(PromptError, match=r"^in\.jsonl line 1 \(custom_id 'a'\): url '/v1/x' is not supported"):
        read({**completion("a", "x"), "url": "/v1/x"})
    with pytest.raises(PromptError, match=r"^in\.jsonl line 1: missing field 'custom_id'$"):
        read({k: v for k, v in completion("a", "x").items() if k != "custom_id"})


def test_min_tokens_is_checked_against_the_jobs_budget_not_flexoffs_default(chat_opt, tmp_path, capsys):
    read(completion("a", "x", min_tokens=40))  # flexoff's default budget is 32; the job's may be more
    source = write_jsonl(tmp_path / "in.jsonl", [completion("ok", "the cat", max_tokens=2),
                                                 completion("long", "the cat", min_tokens=40)])
    assert main(batch_args(chat_opt[0], source, tmp_path / "out.jsonl")) == 2
    assert capsys.readouterr().err.strip() == (f"flexoff: error: {source} line 2 (custom_id 'long'): "
                                               "min_tokens=40 is more than max_tokens=32")
    assert main(batch_args(chat_opt[0], source, tmp_path / "out.jsonl", "--max-new-tokens", "41")) == 0


def test_a_prompt_too_long_for_the_model_is_named_by_line_and_custom_id(chat_opt, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [completion("ok", "the cat", max_tokens=2),
                                                 completion("long", "the cat", max_tokens=5000)])
    assert main(batch_args(chat_opt[0], source, tmp_path / "out.jsonl")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flexoff: error: {source} line 2 (custom_id 'long'): the prompt has ")
    assert "batch_req_" not in err


def test_a_file_with_default_fields_runs_as_one_without_them(chat_opt, tmp_path):
    plain = [completion("c", "the cat", max_tokens=3), chat("h", CHATS[0], max_tokens=3)]
    full = [completion("c", ["the cat"], max_tokens=3, **NEUTRAL_COMPLETION),
            chat("h", CHATS[0], max_tokens=3, **NEUTRAL_CHAT)]
    got = []
    for name, rows in (("plain", plain), ("full", full)):
        output = tmp_path / f"{name}.out.jsonl"
        assert main(batch_args(chat_opt[0], write_jsonl(tmp_path / f"{name}.jsonl", rows), output)) == 0
        got.append({key: {**row, "response": {**row["response"], "body": {**row["response"]["body"], "created": 0}}}
                    for key, row in responses(output).items()})
    assert got[0] == got[1]


def test_a_list_of_prompts_is_answered_in_one_response_with_each_prompts_choices_in_turn(chat_opt, tmp_path):
    """As OpenAI answers a batched prompt: one response, the first prompt's n choices, then the
    second's, ..., and usage summed; each prompt runs as the same request with that prompt alone
    would (here seeded, so that the draws are the same), in blocks of its own."""
    prompts = ["the cat sat", [5, 6, 7], "the dog ran to"]
    body = {"max_tokens": 3, "n": 2, "temperature": 0.8, "seed": 7}
    rows = [completion("many", prompts, **body)] + [completion(f"one{i}", p, **body) for i, p in enumerate(prompts)]
    output = tmp_path / "out.jsonl"
    assert main(batch_args(chat_opt[0], write_jsonl(tmp_path / "in.jsonl", rows), output)) == 0
    got = {key: row["response"]["body"] for key, row in responses(output).items()}
    alone = [got[f"one{i}"] for i in range(len(prompts))]
    expected = [{**choice, "index": index}
                for index, choice in enumerate(c for body in alone for c in body["choices"])]
    assert got["many"]["choices"] == expected and len(expected) == 6
    assert got["many"]["usage"] == {key: sum(body["usage"][key] for body in alone) for key in got["many"]["usage"]}


def test_a_prompt_of_a_list_too_long_for_the_model_is_named_by_its_place(chat_opt, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [completion("m", ["the cat", "the dog " * 600], max_tokens=2)])
    assert main(batch_args(chat_opt[0], source, tmp_path / "out.jsonl")) == 2
    assert capsys.readouterr().err.startswith(f"flexoff: error: {source} line 1 (custom_id 'm'): the prompt 1 has ")


def test_the_planners_workload_counts_every_prompt_of_a_list(chat_opt, tmp_path):
    from flexoff.commands.llm import job_deployment
    from flexoff.harness.batch import open_batch
    from flexoff.job import Job

    source = write_jsonl(tmp_path / "in.jsonl", [completion("m", [[5] * 9, [5, 6]], max_tokens=4),
                                                 completion("o", [5, 6, 7], max_tokens=2)])
    job = Job(model=str(chat_opt[0]), device="cpu")
    batch = open_batch(job, job_deployment(job), source, tmp_path / "out.jsonl", 32)
    try:
        workload = batch.workload()
    finally:
        batch.close()
    assert (workload.prompt_len, workload.gen_len, workload.num_prompts) == (9, 4, 3)
