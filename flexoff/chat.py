"""Chat conversations: the one check of a message list, and a conversation turned into prompt token ids
through the tokenizer's chat template (for ``LLM.chat``, ``flexoff run --chat`` and chat lines of
``flexoff batch``).

A conversation is a list of messages, each a dict with a ``role`` (text) and a ``content``: text, or
OpenAI's list of text parts (``[{"type": "text", "text": ...}]``, joined with newlines as vLLM does).
Other keys of a message (``name``, ...) reach the template untouched.
"""

from __future__ import annotations

from .errors import ArgumentTypeError, PromptError, TokenizerError


def is_conversation(value) -> bool:
    """Whether ``value`` is shaped as one conversation (a list whose items are dicts)."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) for m in value)


def conversation_list(messages) -> list[list[dict]]:
    """vLLM's shapes for ``LLM.chat``: one conversation, or a list of conversations."""
    if not isinstance(messages, (list, tuple)):
        raise ArgumentTypeError(f"messages must be a list of message dicts or a list of such lists, "
                                f"got {type(messages).__name__}")
    if not messages:
        raise PromptError("the message list is empty")
    if all(isinstance(m, dict) for m in messages):
        return [check_conversation(messages, "conversation 0")]
    return [check_conversation(c, f"conversation {i}") for i, c in enumerate(messages)]


def check_conversation(conversation, what: str) -> list[dict]:
    """A conversation's messages, checked, with text-part contents joined into text."""
    if not isinstance(conversation, (list, tuple)):
        raise ArgumentTypeError(f"{what} must be a list of messages, got {type(conversation).__name__}")
    if not conversation:
        raise PromptError(f"{what} has no messages")
    return [_check_message(message, f"{what}, message {i}") for i, message in enumerate(conversation)]


def _check_message(message, what: str) -> dict:
    if not isinstance(message, dict):
        raise ArgumentTypeError(f"{what} must be a dict with 'role' and 'content', got {type(message).__name__}")
    for key in ("role", "content"):
        if key not in message:
            raise PromptError(f"{what} has no {key!r}; a message is {{\"role\": ..., \"content\": ...}}")
    if not isinstance(message["role"], str) or not message["role"]:
        raise PromptError(f"{what}: 'role' must be non-empty text, got {message['role']!r}")
    content = message["content"]
    if isinstance(content, (list, tuple)):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise PromptError(f"{what}: 'content' parts must be {{\"type\": \"text\", \"text\": ...}} "
                              "(flexoff runs text models)")
        content = "\n".join(p["text"] for p in content)
    elif not isinstance(content, str):
        raise PromptError(f"{what}: 'content' must be text or a list of text parts, got {type(content).__name__}")
    return {**message, "content": content}


# Arguments of the template call that chat_prompt sets itself; LLM.chat takes the first two by name.
_TEMPLATE_ARGS = ("add_generation_prompt", "chat_template", "conversation", "tokenize")


def check_template_args(chat_template, chat_template_kwargs) -> None:
    """LLM.chat's template arguments by type: a Jinja string or None, and a dict of the template's
    own variables (by name, none of those the call sets itself) or None."""
    if chat_template is not None and not isinstance(chat_template, str):
        raise ArgumentTypeError(f"chat_template must be a Jinja template string or None, got "
                                f"{type(chat_template).__name__}")
    if chat_template_kwargs is None:
        return
    if not isinstance(chat_template_kwargs, dict):
        raise ArgumentTypeError(f"chat_template_kwargs must be a dict of the template's variables or None, got "
                                f"{type(chat_template_kwargs).__name__}")
    for key in chat_template_kwargs:
        if not isinstance(key, str):
            raise ArgumentTypeError(f"chat_template_kwargs keys must be names (str), got {key!r}")
        if key in _TEMPLATE_ARGS:
            raise ArgumentTypeError(f"chat_template_kwargs key {key!r} is set by LLM.chat itself"
                                    + (f"; pass {key}= to LLM.chat" if key in _TEMPLATE_ARGS[:2] else ""))


def chat_prompt(tokenizer, conversation: list[dict], *, add_generation_prompt: bool = True,
                chat_template: str | None = None, chat_template_kwargs: dict | None = None
                ) -> tuple[str, list[int]]:
    """(the prompt text the chat template makes, its token ids). The template writes the special
    tokens it wants, so none are added when encoding (as vLLM and transformers do)."""
    if tokenizer is None:
        raise TokenizerError("chat needs a tokenizer with a chat template, and this model has none; give a "
                             "checkpoint directory with tokenizer files, or a tokenizer folder")
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, **(chat_template_kwargs or {}))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise PromptError("the chat template made an empty prompt")
    return text, ids
