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
