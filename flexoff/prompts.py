"""Prompt input for the CLI: text or JSONL files, or synthetic token-id prompts for benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import PromptError
from .fileio import jsonl_objects
from .models import ModelConfig


@dataclass
class PromptLine:
    """One prompt from a file: text or token ids, with optional per-line overrides."""

    prompt: str | list[int]
    id: str | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()


def read_prompts(path: str | Path) -> list[PromptLine]:
    """``.jsonl``: one object per line with "prompt" (text or token ids) and optional "id",
    "max_new_tokens" and "stop". Any other file: one text prompt per non-blank line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptError(f"cannot read prompts file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if path.suffix != ".jsonl":
        lines = [PromptLine(line) for line in text.splitlines() if line.strip()]
    else:
        lines = [_prompt_line(where, record) for _, where, record in jsonl_objects(path, text, PromptError)]
    if not lines:
        raise PromptError(f"prompts file {path} holds no prompts")
    return lines


def _prompt_line(where: str, record: dict) -> PromptLine:
    prompt = record.get("prompt")
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or is_ids):
        raise PromptError(f"{where}: \"prompt\" must be a string or a list of token ids")
    if not prompt:
        raise PromptError(f"{where}: the prompt is empty")
    max_new = record.get("max_new_tokens")
    if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1):
        raise PromptError(f"{where}: \"max_new_tokens\" must be an integer >= 1")
    stop = record.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise PromptError(f"{where}: \"stop\" must be a string or a list of non-empty strings")
    record_id = record.get("id")
    return PromptLine(prompt, None if record_id is None else str(record_id), max_new, tuple(stop))


def synthetic_prompts(cfg: ModelConfig, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids, avoiding the low ids where OPT and Llama 2
    keep their special tokens."""
    if count < 1 or length < 1:
        raise PromptError("--num-prompts and --prompt-len must be >= 1")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, cfg.vocab_size, (count, length), generator=generator)
    return ids.tolist()


def prompt_workload(prompts, budgets, model: str, tokenizer: str | None):
    """The planner's workload for a job: its longest prompt in tokens (text tokenized as the model
    will tokenize it; a Hub id's tokenizer files are fetched, not its weights), its largest generation
    budget, and its number of prompts."""
    from .errors import TokenizerError
    from .planner.cost_model import Workload
    from .tokenizer import Tokenizer

    encoder = None
    lengths = []
    for prompt in prompts:
        if not isinstance(prompt, str):
            lengths.append(len(prompt))
            continue
        if encoder is None:
            encoder = Tokenizer.for_model(model, tokenizer)
            if encoder is None:
                raise TokenizerError(f"text prompts need a tokenizer, and model {model!r} has none; give token "
                                     "ids, --tokenizer DIR, or a checkpoint (directory or Hub id) with tokenizer files")
        lengths.append(len(encoder.encode(prompt)))
    return Workload(max(lengths), max(budgets), len(lengths))
