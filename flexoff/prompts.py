"""Prompt input: the one check of a prompt (for files and the API), prompts files (text, JSONL or JSON),
and synthetic token-id prompts for benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .chat import chat_prompt, check_conversation, is_conversation
from .checks import is_int
from .errors import FlexoffError, PromptError, TokenizerError
from .fileio import jsonl_objects, read_user_text
from .models import ModelConfig


PROMPT_FIELDS = ("id", "prompt", "messages", "max_new_tokens", "stop", "meta")


@dataclass(frozen=True)
class PromptLine:
    """One prompt from a file: text or token ids, or a chat conversation (``messages``, and no
    ``prompt``), with optional per-line overrides."""

    prompt: str | list[int] | None
    id: str | int | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    meta: object = None  # any JSON value, copied to the line's result by `flexoff batch`
    line: int = 0  # 1-based line (JSONL) or item (JSON) number in the file; 0 when unknown
    messages: list[dict] | None = None  # a conversation, put through the chat template


def check_prompt(prompt, what: str, vocab_size: int | None = None, type_error: type[Exception] = PromptError
                 ) -> str | list[int]:
    """The one check of a prompt, for files and the Python API: non-empty text, or a non-empty list of
    token ids (integers >= 0, below ``vocab_size`` when given). ``what`` names it in messages
    ("prompt 3", "FILE line 2: field 'prompt'"); a prompt of the wrong type raises ``type_error``."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError(f"{what} is empty")
        return prompt
    if not isinstance(prompt, (list, tuple)):
        raise type_error(f"{what} must be text or a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise PromptError(f"{what} is an empty token list")
    if not all(is_int(t) and t >= 0 for t in prompt):
        bad = next(t for t in prompt if not (is_int(t) and t >= 0))
        raise type_error(f"{what} must be text or a list of token ids (integers >= 0), but holds {bad!r}")
    if vocab_size is not None and max(prompt) >= vocab_size:
        raise PromptError(f"{what} has token id {max(prompt)}, outside the vocabulary of {vocab_size}")
    return list(prompt)


def prompt_ids(prompt, what: str, cfg: ModelConfig, tokenizer, type_error: type[Exception] = PromptError
               ) -> list[int]:
    """A checked prompt as token ids: text is tokenized (and needs a tokenizer), ids are checked
    against the vocabulary. ``what`` names the prompt in messages; see check_prompt for ``type_error``."""
    prompt = check_prompt(prompt, what, cfg.vocab_size, type_error=type_error)
    if not isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        raise TokenizerError(f"{what} is text, but model {cfg.name!r} has no tokenizer; give token ids, or a "
                             "checkpoint directory with tokenizer files")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise PromptError(f"{what} is empty once tokenized")
    return ids


def check_room(ids: list[int], max_new_tokens: int, what: str, cfg: ModelConfig) -> None:
    """Refuse a prompt that leaves no room for its generation budget in the model's positions."""
    if len(ids) + max_new_tokens > cfg.max_positions:
        raise PromptError(f"{what} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                          f"{len(ids) + max_new_tokens} positions, but {cfg.name} has {cfg.max_positions}")


def prompt_record(obj: dict, where: str, line: int = 0, id_required: bool = False) -> PromptLine:
    """One JSON object of a prompts file (``flexoff run --prompts``, ``flexoff batch --input``), checked
    field by field: see PROMPT_FIELDS."""
    unknown = sorted(set(obj) - set(PROMPT_FIELDS))
    if unknown:
        raise PromptError(f"{where}: unknown field {unknown[0]!r}; known fields: {', '.join(PROMPT_FIELDS)} "
                          "(put other data under \"meta\")")
    if id_required and "id" not in obj:
        raise PromptError(f"{where}: missing field 'id'")
    line_id = obj.get("id")
    if line_id is not None and not (is_int(line_id) or (isinstance(line_id, str) and line_id)):
        raise PromptError(f"{where}: field 'id' must be a non-empty string or an integer, got {line_id!r}")
    if ("prompt" in obj) == ("messages" in obj):
        raise PromptError(f"{where}: " + ("give 'prompt' or 'messages', not both" if "prompt" in obj
                                          else "missing field 'prompt' (or 'messages', for a chat)"))
    prompt = messages = None
    if "prompt" in obj:
        prompt = check_prompt(obj["prompt"], f"{where}: field 'prompt'")
    else:
        messages = check_conversation(obj["messages"], f"{where}: field 'messages'")
    budget = obj.get("max_new_tokens")
    if budget is not None and not (is_int(budget) and budget >= 1):
        raise PromptError(f"{where}: field 'max_new_tokens' must be an integer >= 1, got {budget!r}")
    stop = obj.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise PromptError(f"{where}: field 'stop' must be a string or a list of strings")
    if any(not s for s in stop):
        raise PromptError(f"{where}: field 'stop' has an empty string")
    return PromptLine(prompt, line_id, budget, tuple(stop), obj.get("meta"), line, messages)


def as_chat(line: PromptLine, what: str) -> PromptLine:
    """A text prompt as a conversation of one user message (``flexoff run --chat``); chat lines stay."""
    if line.messages is not None:
        return line
    if not isinstance(line.prompt, str):
        raise PromptError(f"{what} is token ids; chat needs text prompts (or \"messages\")")
    return replace(line, prompt=None, messages=[{"role": "user", "content": line.prompt}])


def line_prompt(line: PromptLine, what: str, cfg: ModelConfig, tokenizer) -> tuple[list[int], str | None]:
    """A file's prompt as (token ids, its text): chat lines through the tokenizer's chat template."""
    if line.messages is None:
        return prompt_ids(line.prompt, what, cfg, tokenizer), line.prompt if isinstance(line.prompt, str) else None
    try:
        text, ids = chat_prompt(tokenizer, line.messages)
    except FlexoffError as exc:
        raise type(exc)(f"{what}: {exc}") from None
    return check_prompt(ids, what, cfg.vocab_size), text


def read_prompts(path: str | Path) -> list[PromptLine]:
    """A prompts file, by its extension (in any case):

    - ``.jsonl``: one JSON object per line with "prompt" (text or token ids) and optional "id",
      "max_new_tokens", "stop" and "meta";
    - ``.json``: one JSON list whose items are such objects, or bare prompts (text or token ids);
    - anything else: text, one prompt per non-blank line.
    """
    path = Path(path)
    text = read_user_text(path, "prompts file", PromptError)
    kind = path.suffix.lower()
    if kind == ".jsonl":
        lines = [prompt_record(obj, where, number) for number, where, obj in jsonl_objects(path, text, PromptError)]
    elif kind == ".json":
        lines = _json_prompts(path, text)
    else:
        lines = [PromptLine(line, line=number) for number, line in enumerate(text.splitlines(), start=1)
                 if line.strip()]
    if not lines:
        raise PromptError(f"prompts file {path} holds no prompts")
    # The run's results carry ids as text.
    return [replace(line, id=str(line.id)) if line.id is not None else line for line in lines]


def _json_prompts(path: Path, text: str) -> list[PromptLine]:
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise PromptError(f"{path} is not valid JSON ({exc}); a .json prompts file holds one list, "
                          "a .jsonl file one object per line") from None
    if not isinstance(items, list):
        raise PromptError(f"{path}: a .json prompts file holds one JSON list of prompts or prompt objects, "
                          f"not a {type(items).__name__}")
    lines = []
    for number, item in enumerate(items, start=1):
        where = f"{path} item {number}"
        if isinstance(item, dict):
            lines.append(prompt_record(item, where, number))
        else:
            lines.append(PromptLine(check_prompt(item, where), line=number))
    return lines


def synthetic_prompts(cfg: ModelConfig, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids, avoiding the low ids where OPT and Llama 2
    keep their special tokens."""
    if count < 1 or length < 1:
        raise PromptError("--num-prompts and --prompt-len must be >= 1")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, cfg.vocab_size, (count, length), generator=generator)
    return ids.tolist()


def prompt_workload(prompts, budgets, model: str, tokenizer: str | None, share: bool = True, keep=None):
    """The planner's workload for a job: its longest prompt in tokens (text tokenized as the model
    will tokenize it, a conversation as the chat template makes it; a Hub id's tokenizer files are
    fetched, not its weights), its largest generation budget, its number of prompts, and the prefix
    its GPU batches' rows share and how many prompts share each, measured from the prompts' token
    ids (``prefixes.job_shared_prefix``, ``prefixes.job_prefix_group``: 0 where they share nothing,
    or ``share`` is off), each prompt's budget where they differ (``Workload.gen_lens``), and their
    mean length where they differ (``Workload.mean_prompt_len``). ``keep``: per prompt, the last
    positions its head reads, its own (a scored continuation and the position before it; default 1)."""
    from .planner.cost_model import Workload
    from .prefixes import job_prefix_group, job_shared_prefix
    from .tokenizer import Tokenizer

    encoder = None
    ids = []
    for prompt in prompts:
        if not isinstance(prompt, str) and not is_conversation(prompt):
            ids.append(prompt)
            continue
        if encoder is None:
            encoder = Tokenizer.for_model(model, tokenizer)
            if encoder is None:
                raise TokenizerError(f"text prompts need a tokenizer, and model {model!r} has none; give token "
                                     "ids, --tokenizer DIR, or a checkpoint (directory or Hub id) with tokenizer files")
        ids.append(chat_prompt(encoder, prompt)[1] if is_conversation(prompt) else encoder.encode(prompt))
    shared = job_shared_prefix(ids, keep) if share else 0
    lengths = [len(p) for p in ids]
    mean = sum(lengths) / len(lengths) if len(set(lengths)) > 1 else 0.0
    return Workload(max(lengths), max(budgets), len(ids), shared_prefix=shared,
                    prefix_group=job_prefix_group(ids, keep) if shared else 0, gen_lens=Workload.differing(budgets),
                    mean_prompt_len=mean)
