"""LLM.chat and get_tokenizer, as vLLM's: conversations through the tokenizer's chat template, checked
token for token against transformers' greedy generation on the templated prompt; and the checkpoint's
generation_config.json (its end-of-sequence ids, and its sampling defaults when none are given)."""

import json
import shutil

import pytest
import torch

from flexoff import LLM, SamplingParams
from flexoff.errors import ConfigError, PromptError, SamplingError, TokenizerError

# Words of the tiny tokenizers' vocabulary, so templated prompts have no unknown tokens.
TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }} {{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}{{ bos_token }}assistant{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "the cat sat on the mat"}],
    [{"role": "system", "content": "a dog"}, {"role": "user", "content": "the big red car moved"},
     {"role": "assistant", "content": "then it was"}, {"role": "user", "content": "bird sang"}],
]


def with_template(source, destination, template=TEMPLATE, generation=None):
    """A copy of the tiny checkpoint at ``source`` whose tokenizer has ``template`` (None: no template)
    and whose generation_config.json holds ``generation`` (None: as saved)."""
    from transformers import AutoTokenizer

    shutil.copytree(source, destination)
    tok = AutoTokenizer.from_pretrained(destination)
    tok.chat_template = template
    tok.save_pretrained(destination)
    if generation is not None:
        (destination / "generation_config.json").write_text(json.dumps(generation))
    return destination


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir, tmp_path_factory):
    """(LLM, transformers model, transformers tokenizer) of a tiny Llama with a chat template."""
    from transformers import AutoTokenizer

    source, hf = tiny_model_dir("llama-gqa")
    path = with_template(source, tmp_path_factory.mktemp("chat") / "llama")
    llm = LLM(str(path), dtype="float32")
    yield llm, hf, AutoTokenizer.from_pretrained(path)
    llm.close()


def hf_greedy(hf, ids, max_tokens, eos=(2,)):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=list(eos), pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_chat_agrees_with_transformers_on_the_templated_prompt(chat_model):
    llm, hf, tok = chat_model
    outputs = llm.chat(CONVERSATIONS, SamplingParams(max_tokens=6))
    for conversation, output in zip(CONVERSATIONS, outputs):
        ids = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]  # transformers 5 gives a BatchEncoding
        text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert output.prompt_token_ids == list(ids) and output.prompt == text
        assert output.outputs[0].token_ids == hf_greedy(hf, list(ids), 6)
    one = llm.chat(CONVERSATIONS[0], sampling_params=SamplingParams(max_tokens=6), use_tqdm=False)
    assert len(one) == 1 and one[0].token_ids == outputs[0].token_ids
    assert llm.get_tokenizer() is llm.tokenizer.hf and llm.get_tokenizer().chat_template == TEMPLATE


def test_add_generation_prompt_and_a_template_given_in_the_call(chat_model):
    llm, _, tok = chat_model
    bare = llm.chat(CONVERSATIONS[0], SamplingParams(max_tokens=2), add_generation_prompt=False)[0]
    assert bare.prompt == tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=False, tokenize=False)
    other = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    given = llm.chat(CONVERSATIONS[0], SamplingParams(max_tokens=2), chat_template=other)[0]
    assert given.prompt == "the cat sat on the mat "
    assert given.prompt_token_ids == tok("the cat sat on the mat ", add_special_tokens=False).input_ids


@pytest.mark.parametrize("messages, error, message", [
    ([{"content": "the cat"}], PromptError, r"conversation 0, message 0 has no 'role'"),
    ([[{"role": "user", "content": "a"}], [{"role": "user"}]], PromptError,
     r"conversation 1, message 0 has no 'content'"),
    ([{"role": "user", "content": 3}], PromptError, r"'content' must be text"),
    ([{"role": "", "content": "a"}], PromptError, r"'role' must be non-empty"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], PromptError, r"runs text models"),
    ([], PromptError, r"the message list is empty"),
    ("the cat", TypeError, r"messages must be a list"),
])
def test_bad_messages_are_refused_before_generating(chat_model, monkeypatch, messages, error, message):
    llm = chat_model[0]
    monkeypatch.setattr(llm.engine, "generate_block", lambda *a, **k: pytest.fail("generated"))
    with pytest.raises(error, match=message) as info:
        llm.chat(messages)
    assert "\n" not in str(info.value)


def test_a_template_that_refuses_a_conversation_names_it(chat_model):
    llm = chat_model[0]
    strict = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}" \
             "{{ m['content'] }}{% endfor %}"
    with pytest.raises(PromptError, match=r"conversation 1: the chat template failed on it: .*no system"):
        llm.chat(CONVERSATIONS, chat_template=strict)


def test_content_parts_are_joined_as_text(chat_model):
    llm = chat_model[0]
    parts = [{"role": "user", "content": [{"type": "text", "text": "the cat"}, {"type": "text", "text": "sat"}]}]
    joined = [{"role": "user", "content": "the cat\nsat"}]
    params = SamplingParams(max_tokens=2)
    assert llm.chat(parts, params)[0].prompt == llm.chat(joined, params)[0].prompt


def test_no_template_and_no_tokenizer_are_one_line_each(tiny_model_dir, tmp_path):
    source, _ = tiny_model_dir("opt-pre")
    with LLM(str(with_template(source, tmp_path / "plain", template=None))) as llm:
        with pytest.raises(TokenizerError, match="has no chat template") as info:
            llm.chat(CONVERSATIONS[0])
        assert "\n" not in str(info.value)
        with pytest.raises(PromptError, match="has no 'role'"):  # the messages are checked first
            llm.chat([{"content": "a"}])
    with LLM("opt-125m", dummy=True) as llm:
        with pytest.raises(TokenizerError, match="has no tokenizer"):
            llm.get_tokenizer()
        with pytest.raises(TokenizerError, match="needs a tokenizer"):
            llm.chat(CONVERSATIONS[0])


def test_generation_config_eos_ids_end_a_sequence(tiny_model_dir, tmp_path):
    source, hf = tiny_model_dir("llama-gqa")
    prompt = "the cat sat on the mat"
    free = LLM(str(source), dtype="float32")
    try:
        ids = free.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    finally:
        free.close()
    stop_at = next(i for i, t in enumerate(ids.token_ids) if i > 0 and t not in ids.token_ids[:i] and t != 2)
    stop_id = ids.token_ids[stop_at]
    path = with_template(source, tmp_path / "eos", generation={"eos_token_id": [2, stop_id]})
    with LLM(str(path), dtype="float32") as llm:
        out = llm.generate(prompt, SamplingParams(max_tokens=8))[0]
        assert out.token_ids == hf_greedy(hf, ids.prompt_token_ids, 8, eos=(2, stop_id))
        assert out.token_ids[-1] == stop_id and out.finish_reason == "stop" and out.stop_reason is None
        assert len(llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids) == 8


@pytest.mark.parametrize("generation, expected", [
    ({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 5},
     dict(temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=5)),
    ({"do_sample": True, "top_p": 0.9}, dict(temperature=1.0, top_p=0.9)),
    ({"temperature": 0.7, "top_p": 0.8, "max_new_tokens": 4}, dict(max_new_tokens=4)),  # no do_sample: greedy
    ({"eos_token_id": 2}, {}),
    ({"repetition_penalty": 1.05, "max_new_tokens": 6}, dict(repetition_penalty=1.05, max_new_tokens=6)),
])
def test_generation_config_sampling_defaults_apply_only_when_none_are_given(tiny_model_dir, tmp_path,
                                                                             generation, expected):
    source, _ = tiny_model_dir("opt-pre")
    path = with_template(source, tmp_path / "gen", generation=generation)
    with LLM(str(path)) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(**expected)
        default = llm.generate(["the cat sat"] * 2)
        given = llm.generate(["the cat sat"] * 2, SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert [len(o.token_ids) for o in given] == [3, 3]
        budget = expected.get("max_new_tokens", 32)
        assert all(len(o.token_ids) <= budget for o in default)
        if expected.get("temperature"):  # sampled with the file's values: per-prompt seeds draw differently
            again = llm.generate(["the cat sat"] * 2, SamplingParams(**expected))
            assert [o.token_ids for o in again] == [o.token_ids for o in default]


def test_a_broken_generation_config_is_one_line(tiny_model_dir, tmp_path):
    source, _ = tiny_model_dir("opt-pre")
    path = with_template(source, tmp_path / "bad", generation={"eos_token_id": "two"})
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id must be"):
        LLM(str(path))
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 1.5}))
    with LLM(str(path)) as llm:
        assert llm.generate("the cat", SamplingParams(max_tokens=2))[0].token_ids  # given params: not read
        with pytest.raises(SamplingError, match=r"the sampling defaults of .*generation_config.json: top_p"):
            llm.generate("the cat")
