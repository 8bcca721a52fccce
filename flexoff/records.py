"""One result record, the same in every results file ``run``, ``batch`` and ``bench`` write.

Each line of a results file is one JSON object with these fields (``bench`` and ``batch`` may add
their own after them, e.g. ``meta``):

- ``index``: the request's place in the job's input; sorting by it gives input order.
- ``id``: the request's id from the input (null when the input gave none).
- ``kind``: "generate", or "score" for a given continuation that was scored (``bench``).
- ``prompt``: the prompt text (null when the prompt was token ids); ``prompt_tokens``: its length.
- ``text``, ``token_ids``, ``logprobs`` (one per token), ``generated_tokens``.
- ``finish_reason``: "stop", "length", or "error" (then ``error`` says why, and there are no tokens).
- ``block_size``, ``block_seconds``, ``finished_at``: the block the request ran in.

The JSON is strict (a non-finite log-probability is written as null) and UTF-8.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from .fileio import json_text

RECORD_FIELDS = ("index", "id", "kind", "prompt", "prompt_tokens", "text", "token_ids", "logprobs",
                 "generated_tokens", "finish_reason", "error", "block_size", "block_seconds", "finished_at")


@dataclass(frozen=True)
class Block:
    """Where a request ran: how many requests shared its block, how long the block took, and when
    it finished."""
    size: int
    seconds: float
    finished_at: str

    @classmethod
    def now(cls, size: int, seconds: float) -> "Block":
        return cls(size, round(seconds, 6), datetime.now(timezone.utc).isoformat(timespec="seconds"))


def generation_record(out, block: Block, *, index: int | None = None, id=None, prompt: str | None = None,
                      extra: dict | None = None) -> dict:
    """The record of one ``RequestOutput``; ``index`` defaults to the output's own, ``prompt`` (the
    text, where the output was generated from its token ids) to the output's."""
    return {
        "index": out.index if index is None else index, "id": id, "kind": "generate",
        "prompt": out.prompt if prompt is None else prompt,
        "prompt_tokens": len(out.prompt_token_ids), "text": out.text, "token_ids": list(out.token_ids),
        "logprobs": list(out.logprobs), "generated_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
        "error": out.error, "block_size": block.size, "block_seconds": block.seconds,
        "finished_at": block.finished_at, **(extra or {}),
    }


def score_record(out, block: Block, *, index: int, id, prompt, prompt_tokens: int, continuation,
                 extra: dict | None = None) -> dict:
    """The record of one ``ScoreOutput``: the continuation's tokens were given, not generated."""
    return {
        "index": index, "id": id, "kind": "score", "prompt": prompt if isinstance(prompt, str) else None,
        "prompt_tokens": prompt_tokens, "text": continuation if isinstance(continuation, str) else None,
        "token_ids": list(out.token_ids), "logprobs": list(out.logprobs), "generated_tokens": 0,
        "finish_reason": None, "error": None, "block_size": block.size, "block_seconds": block.seconds,
        "finished_at": block.finished_at, **(extra or {}),
    }


def record_line(record: dict) -> str:
    """One line of a results file, without its newline."""
    return json_text(record)


def failed(records) -> list[dict]:
    return [r for r in records if r.get("finish_reason") == "error"]


def failure_line(records) -> str | None:
    """"N of M sequences failed: REASON" for records that carry an error; None when none do."""
    records = list(records)
    errors = failed(records)
    if not errors:
        return None
    reasons = list(dict.fromkeys(str(r.get("error")) for r in errors))
    more = f" (and {len(reasons) - 1} other reason{'s' if len(reasons) > 2 else ''})" if len(reasons) > 1 else ""
    return f"{len(errors)} of {len(records)} sequences failed: {reasons[0]}{more}"
