"""OpenAI Batch API files in ``flexoff batch``: the input format vLLM's batch runner reads, and its output.

Input, one request a line (a file whose first line has ``custom_id`` is read this way throughout)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "Paris is", "max_tokens": 16}}
    {"custom_id": "r2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7, "seed": 3}}

- ``url``: ``/v1/completions`` (``prompt``: text or token ids, or a list of several, which run as
  sequences of their own and are answered, as OpenAI answers them, in one response whose choices
  are the first prompt's ``n``, then the second's, ...) or ``/v1/chat/completions`` (``messages``,
  through the chat template as ``LLM.chat`` does).
- ``model`` is not checked: every request runs on the job's ``--model``, which the response names.
  ``user`` is accepted and not used. A field set to null is taken as left out, as OpenAI takes it.
- Fields OpenAI documents whose default changes nothing here are accepted at it (NEUTRAL_FIELDS:
  ``"stream": false``, ``"echo": false``, ``"logit_bias": {}``, ``"suffix": ""``, ``"tools": []``,
  ``"response_format": {"type": "text"}``, ..., and ``best_of`` equal to ``n``); any other value of
  them is refused by name.
- ``max_tokens`` (or ``max_completion_tokens``), ``stop`` and the sampling fields override the
  job's flags for that request; fields left out take the flags' values (flexoff's defaults: greedy,
  32 tokens; OpenAI's are temperature 1 and 16 tokens for completions). The sampling fields are
  ``SamplingParams``' (``temperature``, ``top_p``, ``top_k``, ``seed``, ``n``, ``stop_token_ids``,
  ``ignore_eos``, the penalties, ...) with its rules, so what it refuses is refused here by name.
- ``logprobs``: the sampled tokens' log-probabilities (completions: ``logprobs: K``; chat:
  ``logprobs: true`` with ``top_logprobs: K``), each with the K likeliest alternatives, for every
  one of the ``n`` choices.
- Any other field, an unknown ``url`` or a method other than POST is refused, naming the line, its
  ``custom_id`` and the field, before anything runs.

Output, one line a request: ``{"id", "custom_id", "response": {"status_code": 200, "request_id",
"body": a text_completion or chat.completion object with choices and usage}, "error": null}``; a
request whose sequence failed gets status 500 and an ``error``. Ids are derived from ``custom_id``,
so a resumed job writes what an uninterrupted one would (all but ``created``, the time).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field

from ..chat import check_conversation
from ..checks import is_int
from ..errors import FlexoffError, PromptError
from ..prompts import PromptLine, check_prompt
from ..records import failure_line
from ..runtime.sampling import SamplingParams

URLS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
LINE_FIELDS = ("custom_id", "method", "url", "body")
# Body fields passed to SamplingParams as they are.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "n", "stop_token_ids", "ignore_eos", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "include_stop_str_in_output")
_COMMON = ("model", "max_tokens", "max_completion_tokens", "stop", "user", "logprobs") + SAMPLING_FIELDS
BODY_FIELDS = {"completion": _COMMON + ("prompt",), "chat": _COMMON + ("messages", "top_logprobs")}
# Fields OpenAI documents whose default (or null) changes nothing flexoff does, by endpoint: accepted
# at those values, refused by name at any other. best_of is neutral at n, checked apart.
_NEUTRAL_COMMON = {"stream": [False], "stream_options": [], "logit_bias": [{}]}
NEUTRAL_FIELDS = {
    "completion": {**_NEUTRAL_COMMON, "echo": [False], "suffix": [""], "best_of": []},
    "chat": {**_NEUTRAL_COMMON, "store": [False], "tools": [[]], "tool_choice": ["none"], "functions": [[]],
             "function_call": ["none"], "parallel_tool_calls": [True], "response_format": [{"type": "text"}],
             "modalities": [["text"]], "audio": [], "prediction": []},
}


def is_openai_line(obj: dict) -> bool:
    return "custom_id" in obj


@dataclass(frozen=True)
class OpenAIRequest:
    """One request line: the prompt line the job runs (its ``id`` is the output's id) and the rest."""

    line: PromptLine
    custom_id: str
    kind: str  # "completion" or "chat"
    # SamplingParams fields the body sets; "logprobs" (alternatives per token) when it asks for them
    sampling: dict = field(default_factory=dict)
    # A completion's prompts where its body lists several (the line's prompt is the first): each
    # runs as its own sequence, and the response holds all their choices, prompt by prompt.
    prompts: tuple = ()


def output_id(custom_id: str) -> str:
    return "batch_req_" + hashlib.sha256(custom_id.encode()).hexdigest()[:32]


def read_request(obj: dict, where: str, number: int) -> OpenAIRequest:
    """One line of an OpenAI batch file, checked field by field; an error names the line and, once
    it is known, the custom_id."""
    custom_id = obj.get("custom_id")
    if "custom_id" not in obj:
        raise PromptError(f"{where}: missing field 'custom_id'")
    if not isinstance(custom_id, str) or not custom_id:
        raise PromptError(f"{where}: field 'custom_id' must be non-empty text, got {custom_id!r}")
    where = f"{where} (custom_id {custom_id!r})"
    for key in obj:
        if key not in LINE_FIELDS:
            raise PromptError(f"{where}: unknown field {key!r}; a request line has {', '.join(LINE_FIELDS)}")
    for key in LINE_FIELDS:
        if key not in obj:
            raise PromptError(f"{where}: missing field {key!r}")
    if obj["method"] != "POST":
        raise PromptError(f"{where}: field 'method' must be \"POST\", got {obj['method']!r}")
    kind = URLS.get(obj["url"])
    if kind is None:
        raise PromptError(f"{where}: url {obj['url']!r} is not supported; use {' or '.join(URLS)}")
    if not isinstance(obj["body"], dict):
        raise PromptError(f"{where}: field 'body' must be a JSON object")
    body = _body(obj["body"], kind, obj["url"], where)
    prompt = messages = None
    prompts = ()
    if kind == "completion":
        if "prompt" not in body:
            raise PromptError(f"{where}: body field 'prompt' is missing")
        prompts = _prompts(body["prompt"], f"{where}: body field 'prompt'")
        prompt, prompts = prompts[0], prompts if len(prompts) > 1 else ()
    else:
        if "messages" not in body:
            raise PromptError(f"{where}: body field 'messages' is missing")
        messages = check_conversation(body["messages"], f"{where}: body field 'messages'")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise PromptError(f"{where}: body field 'model' must be text")
    budget = _budget(body, where)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise PromptError(f"{where}: body field 'stop' must be a string or a list of non-empty strings")
    sampling = {key: body[key] for key in SAMPLING_FIELDS if key in body}
    try:  # under the body's budget, or one no min_tokens exceeds: the job's is checked with the job's flags
        SamplingParams(**sampling, max_new_tokens=budget or sys.maxsize)
    except FlexoffError as exc:  # its message names the field
        raise PromptError(f"{where}: body: {exc}") from None
    logprobs = _logprobs(body, kind, where)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    line = PromptLine(prompt, output_id(custom_id), budget, tuple(stop), None, number, messages)
    return OpenAIRequest(line, custom_id, kind, sampling, prompts)


def _body(body: dict, kind: str, url: str, where: str) -> dict:
    """The body's fields that say something: null is OpenAI's "not given", and a neutral field at its
    neutral value is dropped; any other field is refused by name."""
    neutral = NEUTRAL_FIELDS[kind]
    for key, value in body.items():
        if key not in BODY_FIELDS[kind] and key not in neutral:
            raise PromptError(f"{where}: body field {key!r} is not supported for {url}")
        if key == "best_of":
            if value is not None and not (is_int(value) and value == (body.get("n") or 1)):
                raise PromptError(f"{where}: body field 'best_of' must equal n (default 1): flexoff returns "
                                  f"every choice it generates; got {value!r}")
        elif key in neutral and value is not None and not any(_same(value, v) for v in neutral[key]):
            allowed = " or ".join(json.dumps(v) for v in [*neutral[key], None])
            raise PromptError(f"{where}: body field {key!r} is not supported for {url} except as {allowed}, "
                              f"got {json.dumps(value)}")
    return {key: value for key, value in body.items() if value is not None and key not in neutral}


def _same(value, neutral) -> bool:
    """JSON equality, where true is not 1 and false is not 0 (as Python's == has it)."""
    return type(value) is type(neutral) and value == neutral


def _prompts(prompt, what: str) -> tuple:
    """A completion's prompts: text or token ids, or a list of several of them (OpenAI's batched
    prompt, which it answers with every prompt's choices in one response)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return tuple(check_prompt(p, f"{what}, prompt {i}") for i, p in enumerate(prompt))
    return (check_prompt(prompt, what),)


def _budget(body: dict, where: str) -> int | None:
    values = {key: body[key] for key in ("max_tokens", "max_completion_tokens") if body.get(key) is not None}
    for key, value in values.items():
        if not (is_int(value) and value >= 1):
            raise PromptError(f"{where}: body field {key!r} must be an integer >= 1, got {value!r}")
    if len(set(values.values())) > 1:
        raise PromptError(f"{where}: body fields 'max_tokens' and 'max_completion_tokens' disagree; give one")
    return next(iter(values.values()), None)


def _logprobs(body: dict, kind: str, where: str) -> int | None:
    """How many alternatives per token the request asks for with the sampled tokens' log-probabilities,
    or None where it asks for none."""
    value = body.get("logprobs")
    if kind == "completion":
        if value is not None and not (is_int(value) and value >= 0):
            raise PromptError(f"{where}: body field 'logprobs' must be an integer >= 0 or null, got {value!r}")
        return value
    if value is not None and not isinstance(value, bool):
        raise PromptError(f"{where}: body field 'logprobs' must be true or false, got {value!r}")
    top = body.get("top_logprobs")
    if top is not None and not (is_int(top) and top >= 0):
        raise PromptError(f"{where}: body field 'top_logprobs' must be an integer >= 0, got {top!r}")
    if top and not value:
        raise PromptError(f"{where}: body field 'top_logprobs' needs 'logprobs': true")
    return (top or 0) if value else None


class Responses:
    """``make_record`` for run_generation: a request's output line once the outputs of all its
    prompts are in (None until then, so that a request is written whole or not at all)."""

    def __init__(self, model: str, decode):
        self.model, self.decode = model, decode
        self.waiting: dict[str, dict[int, object]] = {}

    def record(self, item, out, block) -> dict | None:
        request = item.request
        got = self.waiting.setdefault(request.custom_id, {})
        got[item.part] = out
        if len(got) < max(1, len(request.prompts)):
            return None
        del self.waiting[request.custom_id]
        return response_record(request, [got[part] for part in sorted(got)], self.model, self.decode)


def response_record(request: OpenAIRequest, outs: list, model: str, decode) -> dict:
    """The output line of one request from the outputs of its prompts: OpenAI's batch output, with
    a completion or chat.completion body (choices numbered prompt by prompt, as OpenAI numbers a
    batched prompt's). ``decode`` turns one token id into its text (for logprobs), or is None."""
    digest = request.line.id.removeprefix("batch_req_")
    record = {"id": request.line.id, "custom_id": request.custom_id}
    failed = next((out for out in outs if out.finish_reason == "error"), None)
    if failed is not None:
        return {**record, "response": {"status_code": 500, "request_id": f"flexoff-{digest}", "body": None},
                "error": {"code": "generation_failed", "message": failed.error}}
    chat = request.kind == "chat"
    top = request.sampling.get("logprobs")
    choices = []
    for out in outs:
        offset = len(choices)
        for choice in out.outputs:
            logprobs = None if top is None else _choice_logprobs(choice, top, decode, chat)
            index = offset + choice.index
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": choice.text},
                                "logprobs": logprobs, "finish_reason": choice.finish_reason,
                                "stop_reason": choice.stop_reason})
            else:
                choices.append({"index": index, "text": choice.text, "logprobs": logprobs,
                                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
    generated = sum(len(choice.token_ids) for out in outs for choice in out.outputs)
    body = {"id": ("chatcmpl-" if chat else "cmpl-") + digest,
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                      "total_tokens": prompt_tokens + generated}}
    return {**record, "response": {"status_code": 200, "request_id": f"flexoff-{digest}", "body": body}, "error": None}


def _choice_logprobs(choice, top: int, decode, chat: bool) -> dict:
    """One choice's log-probabilities in OpenAI's shape: per token the sampled one's, and the ``top``
    likeliest alternatives; completions list the sampled token among them too, as vLLM does."""
    def text(token_id: int) -> str:
        return decode([token_id]) if decode is not None else str(token_id)

    tokens = [text(t) for t in choice.token_ids]
    values = [entries[t].logprob for t, entries in zip(choice.token_ids, choice.logprobs)]
    alternatives = [sorted((e.rank, i, e.logprob) for i, e in entries.items() if e.rank <= top or not chat)
                    for entries in choice.logprobs]
    if chat:
        return {"content": [{"token": token, "logprob": value, "bytes": list(token.encode("utf-8")),
                             "top_logprobs": [{"token": text(i), "logprob": lp, "bytes": list(text(i).encode("utf-8"))}
                                              for _, i, lp in alts]}
                            for token, value, alts in zip(tokens, values, alternatives)]}
    return {"tokens": tokens, "token_logprobs": values,
            "top_logprobs": [{text(i): lp for _, i, lp in alts} for alts in alternatives]}


def response_failures(records) -> str | None:
    """'N of M requests failed: REASON', or None, for records of this format."""
    line = failure_line({"finish_reason": "error" if r.get("error") else None,
                         "error": (r.get("error") or {}).get("message")} for r in records)
    return line.replace("sequences failed", "requests failed") if line else None
