"""OpenAI Batch API files through ``flexoff batch``: completions and chat requests give what the API
gives for the same parameters, in OpenAI's output format; bad lines are refused before anything
runs; a killed job resumed equals an uninterrupted one."""

import json
import os
import sys

import pytest

from flexoff import SamplingParams
from flexoff.commands.main import main
from flexoff.harness.store import read_records
from tests import processes

from .conftest import REPO, kill_after_lines, write_jsonl
from .test_chat_jobs import CHATS

WORDS = "the cat sat on the mat and the dog ran to the house".split()


def completion(custom_id, prompt, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, **body}}


def chat(custom_id, messages, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": messages, **body}}


def batch_args(model, source, output, *extra):
    return ["batch", "--model", str(model), "--input", str(source), "--output", str(output), "--no-progress",
            "--gpu-batch-size", "2", *extra]


def responses(path) -> dict:
    rows = read_records(path)[1]
    assert len({r["custom_id"] for r in rows}) == len(rows)
    return {r["custom_id"]: r for r in rows}


def test_completions_and_chats_match_the_api_in_openai_format(chat_opt, tmp_path):
    path, llm = chat_opt
    rows = [completion("c0", "the cat sat", max_tokens=4, logprobs=0),
            completion("c1", "the dog ran to", temperature=0.9, seed=7, top_p=0.9, stop=[" the"]),
            chat("h0", CHATS[0], max_completion_tokens=3, logprobs=True),
            chat("h1", CHATS[1], temperature=0.7, seed=11, max_tokens=6)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    assert main(batch_args(path, source, output, "--max-new-tokens", "5")) == 0
    got = responses(output)
    expected = {
        "c0": llm.generate("the cat sat", SamplingParams(max_tokens=4))[0],
        "c1": llm.generate("the dog ran to", SamplingParams(max_tokens=5, temperature=0.9, seed=7, top_p=0.9,
                                                            stop=[" the"]))[0],
        "h0": llm.chat(CHATS[0], SamplingParams(max_tokens=3))[0],
        "h1": llm.chat(CHATS[1], SamplingParams(max_tokens=6, temperature=0.7, seed=11))[0],
    }
    for custom_id, out in expected.items():
        record = got[custom_id]
        assert record["id"].startswith("batch_req_") and record["error"] is None
        response = record["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        is_chat = custom_id.startswith("h")
        assert body["object"] == ("chat.completion" if is_chat else "text_completion")
        assert body["model"] == str(path) and isinstance(body["created"], int)
        assert body["usage"] == {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                                 "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}
        choice, = body["choices"]
        text = choice["message"]["content"] if is_chat else choice["text"]
        assert (choice["index"], text, choice["finish_reason"]) == (0, out.text, out.finish_reason)
    decode = llm.tokenizer.decode
    c0 = got["c0"]["response"]["body"]["choices"][0]["logprobs"]
    assert c0["token_logprobs"] == pytest.approx(expected["c0"].logprobs, abs=1e-5)
    assert c0["tokens"] == [decode([t]) for t in expected["c0"].token_ids]
    h0 = got["h0"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in h0] == pytest.approx(expected["h0"].logprobs, abs=1e-5)
    assert got["h1"]["response"]["body"]["choices"][0]["logprobs"] is None
    assert got["h1"]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"


LINE = completion("a", "the cat")
BAD = {
    "unknown url": ({**LINE, "url": "/v1/embeddings"}, "url '/v1/embeddings' is not supported"),
    "unknown line field": ({**LINE, "priority": 1}, "unknown field 'priority'"),
    "unknown body field": (completion("a", "the cat", echo=True), "body field 'echo' is not supported"),
    "chat field on completions": (completion("a", "x", top_logprobs=1), "body field 'top_logprobs' is not supported"),
    "GET": ({**LINE, "method": "GET"}, "field 'method' must be \"POST\""),
    "no body": ({k: v for k, v in LINE.items() if k != "body"}, "missing field 'body'"),
    "n": (completion("a", "x", n=0), "body: n must be"),
    "logprobs k": (completion("a", "x", logprobs=-1), "body field 'logprobs' must be an integer >= 0"),
    "top_logprobs": (chat("a", CHATS[0], top_logprobs=2), "'top_logprobs' needs 'logprobs': true"),
    "temperature": (completion("a", "x", temperature=-1), "body: temperature must be"),
    "budgets disagree": (chat("a", CHATS[0], max_tokens=3, max_completion_tokens=4), "disagree"),
    "no messages": ({**chat("a", CHATS[0]), "body": {"model": "m"}}, "body field 'messages' is missing"),
    "no role": (chat("a", [{"content": "x"}]), "body field 'messages', message 0 has no 'role'"),
    "no custom_id": ({**LINE, "custom_id": ""}, "field 'custom_id' must be non-empty"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_line_is_one_line_naming_it_and_nothing_runs(chat_opt, tmp_path, capsys, case):
    row, message = BAD[case]
    source = write_jsonl(tmp_path / "in.jsonl", [completion("ok", "the cat"), row])
    output = tmp_path / "out.jsonl"
    assert main(batch_args(chat_opt[0], source, output)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{source} line 2" in err and message in err, err
    assert not output.exists()


def test_a_repeated_custom_id_is_refused(chat_opt, tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [completion("x", "the cat"), chat("x", CHATS[0])])
    assert main(batch_args(chat_opt[0], source, tmp_path / "out.jsonl")) == 2
    assert "line 2: duplicate custom_id 'x' (first on line 1)" in capsys.readouterr().err


def test_sigkill_then_rerun_equals_an_uninterrupted_run(chat_opt, tmp_path):
    rows = []
    for i in range(100):
        words = " ".join(WORDS[: 2 + (i * 7) % 11])
        sampled = {"temperature": 0.8} if i % 3 else {}
        rows.append(completion(f"r{i}", words, **sampled) if i % 2 else
                    chat(f"r{i}", [{"role": "user", "content": words}], **sampled))
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "flexoff"]
    flags = ("--max-new-tokens", "16", "--seed", "5")
    reference = tmp_path / "reference.jsonl"
    done = processes.run(command + batch_args(chat_opt[0], source, reference, *flags), env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr

    output = tmp_path / "out.jsonl"
    written = kill_after_lines(command + batch_args(chat_opt[0], source, output, *flags), output, 6, env)
    assert 6 <= written < 100
    with open(output, "ab") as handle:  # as if the kill had landed in the middle of a write
        handle.write(b'{"id": "batch_req_0", "custom_id": "r3", "resp')

    again = processes.run(command + batch_args(chat_opt[0], source, output, *flags), env=env, cwd=REPO)
    assert again.returncode == 0, again.stderr
    assert f"({written} from an earlier run)" in again.stdout

    def untimed(path):
        records = responses(path)
        for record in records.values():
            del record["response"]["body"]["created"]
        return records

    ref, got = untimed(reference), untimed(output)
    assert got == ref and len(got) == 100
    assert len({json.dumps(r["response"]["body"]["choices"][0]) for r in got.values()}) > 50


def test_n_choices_with_their_top_logprobs_match_the_api(chat_opt, tmp_path):
    path, llm = chat_opt
    rows = [completion("c", "the cat sat", max_tokens=4, n=3, temperature=0.8, seed=5, logprobs=2),
            chat("h", CHATS[0], max_tokens=3, n=2, temperature=0.8, seed=9, logprobs=True, top_logprobs=3)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    assert main(batch_args(path, source, output)) == 0
    got = responses(output)
    decode = llm.get_tokenizer().decode
    want_c = llm.generate("the cat sat", SamplingParams(max_tokens=4, n=3, temperature=0.8, seed=5, logprobs=2))[0]
    want_h = llm.chat(CHATS[0], SamplingParams(max_tokens=3, n=2, temperature=0.8, seed=9, logprobs=3))[0]
    choices = got["c"]["response"]["body"]["choices"]
    assert [c["text"] for c in choices] == [o.text for o in want_c.outputs] and len(choices) == 3
    for choice, want in zip(choices, want_c.outputs):
        entries = want.logprobs
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            [e[t].logprob for t, e in zip(want.token_ids, entries)], abs=1e-5)
        # the sampled token and the two likeliest, by their text
        assert [set(d) for d in choice["logprobs"]["top_logprobs"]] == [{decode([i]) for i in e} for e in entries]
    choices = got["h"]["response"]["body"]["choices"]
    assert [c["message"]["content"] for c in choices] == [o.text for o in want_h.outputs]
    for choice, want in zip(choices, want_h.outputs):
        for step, token, entries in zip(choice["logprobs"]["content"], want.token_ids, want.logprobs):
            assert step["logprob"] == pytest.approx(entries[token].logprob, abs=1e-5)
            top = sorted((e.rank, i) for i, e in entries.items() if e.rank <= 3)
            assert [t["token"] for t in step["top_logprobs"]] == [decode([i]) for _, i in top]
            assert len(step["top_logprobs"]) == 3
