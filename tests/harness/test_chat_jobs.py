"""Chats in files: ``flexoff run --chat`` and ``"messages"`` lines of ``flexoff batch`` and ``run --prompts``
go through the chat template as ``LLM.chat`` does, and give its tokens."""

import json

import pytest

from flexoff import LLM, SamplingParams
from flexoff.commands.main import main
from flexoff.errors import PromptError
from flexoff.harness.batch import read_batch_input
from flexoff.harness.store import read_records

from .conftest import write_jsonl

CHATS = [
    [{"role": "user", "content": "the cat sat on the mat"}],
    [{"role": "system", "content": "Answer:"}, {"role": "user", "content": "Question: the dog ran to the house"}],
    [{"role": "user", "content": "0 1 2 3"}, {"role": "assistant", "content": "4 5"}, {"role": "user", "content": "6"}],
]



def test_messages_lines_are_read_and_checked(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "messages": CHATS[1]}, {"id": 2, "prompt": "x"}])
    lines, _ = read_batch_input(path)
    assert lines[0].messages == CHATS[1] and lines[0].prompt is None and lines[1].messages is None
    for row, message in [
        ({"id": 1, "messages": [{"content": "a"}]}, r"line 1: field 'messages', message 0 has no 'role'"),
        ({"id": 1, "messages": []}, r"line 1: field 'messages' has no messages"),
        ({"id": 1, "prompt": "a", "messages": CHATS[0]}, r"line 1: give 'prompt' or 'messages'"),
        ({"id": 1}, r"line 1: missing field 'prompt' \(or 'messages'"),
    ]:
        write_jsonl(path, [row])
        with pytest.raises(PromptError, match=message):
            read_batch_input(path)


def test_batch_chat_lines_give_llm_chat_tokens(chat_opt, tmp_path):
    path, llm = chat_opt
    rows = [{"id": i, "messages": chat} for i, chat in enumerate(CHATS)] + [{"id": "plain", "prompt": "the cat"}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    assert main(["batch", "--model", str(path), "--input", str(source), "--output", str(output), "--no-progress",
                 "--max-new-tokens", "5"]) == 0
    records = {r["id"]: r for r in read_records(output)[1]}
    expected = llm.chat(CHATS, SamplingParams(max_tokens=5))
    for i, out in enumerate(expected):
        assert (records[i]["token_ids"], records[i]["text"], records[i]["prompt"]) == \
            (out.token_ids, out.text, out.prompt)
        assert out.prompt.endswith("### assistant:") and records[i]["prompt_tokens"] == len(out.prompt_token_ids)
    assert records["plain"]["token_ids"] == llm.generate("the cat", SamplingParams(max_tokens=5))[0].token_ids


def test_run_chat_makes_each_prompt_a_user_message(chat_opt, tmp_path):
    path, llm = chat_opt
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat on the mat\nQuestion: the dog ran\n")
    output = tmp_path / "out.jsonl"
    assert main(["run", "--model", str(path), "--prompts", str(prompts), "--chat", "--gen-len", "4", "--quiet",
                 "--output", str(output)]) == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    expected = llm.chat([[{"role": "user", "content": text}] for text in prompts.read_text().splitlines()],
                        SamplingParams(max_tokens=4))
    assert [(r["token_ids"], r["prompt"]) for r in records] == [(o.token_ids, o.prompt) for o in expected]


@pytest.mark.parametrize("case", ["no prompts file", "token ids", "no template"])
def test_run_chat_refusals_are_one_line(chat_opt, tiny_opt, tmp_path, capsys, monkeypatch, case):
    model, prompts = chat_opt[0], tmp_path / "p.jsonl"
    write_jsonl(prompts, [{"prompt": "the cat"}, {"prompt": [5, 6, 7]}])
    argv = ["run", "--model", str(model), "--prompts", str(prompts), "--chat", "--quiet"]
    message = "line 2 is token ids; chat needs text prompts"
    if case == "no prompts file":
        argv = ["run", "--model", str(model), "--chat", "--quiet"]
        message = "--chat needs --prompts FILE"
    elif case == "no template":
        argv[2] = str(tiny_opt[0])
        write_jsonl(prompts, [{"prompt": "the cat"}])
        message = "line 1: the tokenizer in"
    monkeypatch.setattr(LLM, "generate", lambda *a, **k: pytest.fail("generated"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_end_of_sequence_ids_that_generation_config_adds_are_part_of_a_batch_job(chat_opt, tmp_path, capsys):
    import shutil

    from flexoff.harness.store import job_path

    model = tmp_path / "model"
    shutil.copytree(chat_opt[0], model)
    source = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "the cat"}])
    output = tmp_path / "out.jsonl"
    argv = ["batch", "--model", str(model), "--input", str(source), "--output", str(output), "--no-progress",
            "--max-new-tokens", "2"]
    assert main(argv) == 0
    # The saved file repeats config.json's id: the job is named as before generation_config.json was read.
    assert json.loads((model / "generation_config.json").read_text())["eos_token_id"] == 2
    assert "generation_eos_token_ids" not in json.loads(job_path(output).read_text())["identity"]["model"]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    capsys.readouterr()
    assert main(argv) == 2
    assert "different job (its model differs)" in capsys.readouterr().err
