"""LLM.chat's template arguments are checked by type and named, before anything is templated or
generated; a template variable given in chat_template_kwargs reaches the template."""

import pytest

from flexoff import SamplingParams
from flexoff.errors import FlexoffError

from .test_chat import CONVERSATIONS, chat_model  # noqa: F401  (the fixture)


@pytest.mark.parametrize("kwargs, message", [
    ({"chat_template_kwargs": "x"},
     r"^chat_template_kwargs must be a dict of the template's variables or None, got str$"),
    ({"chat_template_kwargs": [("a", 1)]}, r"^chat_template_kwargs must be a dict .* got list$"),
    ({"chat_template_kwargs": {1: "x"}}, r"^chat_template_kwargs keys must be names \(str\), got 1$"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}},
     r"^chat_template_kwargs key 'add_generation_prompt' is set by LLM.chat itself; pass add_generation_prompt="),
    ({"chat_template_kwargs": {"tokenize": True}}, r"^chat_template_kwargs key 'tokenize' is set by LLM.chat itself$"),
    ({"chat_template": 5}, r"^chat_template must be a Jinja template string or None, got int$"),
])
def test_a_template_argument_of_the_wrong_kind_is_refused_by_name(chat_model, monkeypatch,  # noqa: F811
                                                                   kwargs, message):
    llm = chat_model[0]
    monkeypatch.setattr(llm.engine, "generate_block", lambda *a, **k: pytest.fail("generated"))
    with pytest.raises(FlexoffError, match=message):
        llm.chat(CONVERSATIONS[0], **kwargs)


def test_a_template_variable_reaches_the_template(chat_model):  # noqa: F811
    llm = chat_model[0]
    template = "{{ greeting }} {% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat(CONVERSATIONS[0], SamplingParams(max_tokens=1), chat_template=template,
                   chat_template_kwargs={"greeting": "the dog"})[0]
    assert out.prompt == "the dog the cat sat on the mat"
