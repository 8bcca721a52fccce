"""Drive the API over many requests, appending results to a ResultStore as blocks finish.

Requests whose id is already in the store are skipped, so calling these again after a crash
finishes the rest. Sampling seeds come from the request id, never from a request's position in
the list, so a resumed job draws the same tokens as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from ..progress import TokenTracker
from ..records import Block, generation_record, score_record
from ..runtime.metrics import Metrics
from ..runtime.sampling import SamplingParams
from .store import ResultStore, id_key


def request_seed(base_seed: int, request_id, sample: int = 0) -> int:
    """A per-request sampling seed that depends only on the job seed and the request's id."""
    digest = hashlib.sha256(f"{base_seed}\x00{id_key(request_id)}\x00{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


class Progress(Protocol):
    """Where a long job reports how far it is (the command shows it, e.g. as a progress bar)."""

    def start(self, desc: str, unit: str, total: int, done: int) -> None: ...

    def advance(self, count: int, note: str = "") -> None: ...

    def finish(self) -> None: ...


class _Silent:
    def start(self, desc: str, unit: str, total: int, done: int) -> None:
        pass

    def advance(self, count: int, note: str = "") -> None:
        pass

    def finish(self) -> None:
        pass


@dataclass
class GenerationItem:
    id: object  # the id written to the record (a string or an integer)
    prompt: str | list[int]
    params: SamplingParams
    extra: dict = field(default_factory=dict)  # extra fields copied into the record
    index: int | None = None  # the record's index; by default the item's place in the list
    text: str | None = None  # the prompt's text for the record, where ``prompt`` holds its token ids
    request: object = None  # what a record builder other than flexoff's needs (an OpenAI batch request)
    part: int = 0  # which of its request's prompts (an OpenAI completion may list several under one id)


@dataclass
class ScoreItem:
    id: object
    prompt: str | list[int]
    continuation: str | list[int]
    prompt_tokens: int  # the prompt's length in tokens, for the record
    index: int
    extra: dict = field(default_factory=dict)


def run_generation(llm, store: ResultStore, items: list[GenerationItem], *, progress: Progress | None = None,
                   desc: str = "generating", make_record: Callable[[GenerationItem, object, Block], dict] | None = None
                   ) -> Metrics | None:
    """Generate for every item not yet in ``store``; None when there was nothing left to do.
    ``make_record(item, output, block)`` builds a result line (default: flexoff's record), or None
    while the item's request waits for more of its parts."""
    pending = [item if item.index is not None else replace(item, index=i)
               for i, item in enumerate(items) if id_key(item.id) not in store.done]
    if not pending:
        return None
    bar = progress or _Silent()
    budgets = [item.params.max_new_tokens for item in pending]
    done_budget = sum(item.params.max_new_tokens for item in items) - sum(budgets)
    bar.start(desc, "tok", done_budget + sum(budgets), done_budget)
    tracker = _ProgressTracker(bar, len(items), len(items) - len(pending))

    def on_block(outputs, metrics: Metrics) -> None:
        block = Block.now(len(outputs), metrics.total_time)
        records = []
        for out in outputs:
            item = pending[out.index]
            records.append(make_record(item, out, block) if make_record is not None else
                           generation_record(out, block, index=item.index, id=item.id, prompt=item.text,
                                             extra=item.extra))
        store.append([record for record in records if record is not None])  # None: the request has more parts
        tracker.finished(len(outputs))

    try:
        result = llm.generate([item.prompt for item in pending], [item.params for item in pending],
                              on_block=on_block, tracker=tracker)
    finally:
        bar.finish()
    return result.metrics


class _ProgressTracker(TokenTracker):
    """LLM.generate's progress events, shown on a harness Progress in tokens, with the time left
    (prefill included) and the prompts done in its note."""

    def __init__(self, bar: Progress, prompts: int, prompts_done: int):
        self.bar, self.prompts, self.prompts_done = bar, prompts, prompts_done

    def show(self, advance: int) -> None:
        self.bar.advance(advance, f"{self.progress.note()}, {self.prompts_done}/{self.prompts} prompts")

    def finished(self, prompts: int) -> None:
        """A block's prompts are written: the block's last tokens were shown before they were, so
        the note is shown again (else the last block's prompts never appear in it)."""
        self.prompts_done += prompts
        self.show(0)


def run_scoring(llm, store: ResultStore, items: list[ScoreItem], *, chunk_size: int = 256,
                progress: Progress | None = None, desc: str = "scoring") -> int:
    """Score every item not yet in ``store``, a chunk at a time; returns how many were scored."""
    pending = [item for item in items if id_key(item.id) not in store.done]
    # Like lengths together, so each chunk's blocks carry little padding.
    pending.sort(key=lambda item: len(item.prompt) + len(item.continuation))
    bar = progress if progress is not None and pending else _Silent()
    bar.start(desc, "seq", len(items), len(items) - len(pending))
    try:
        for start in range(0, len(pending), chunk_size):
            chunk = pending[start:start + chunk_size]
            started = time.perf_counter()
            outputs = llm.score([item.prompt for item in chunk], [item.continuation for item in chunk])
            block = Block.now(len(chunk), time.perf_counter() - started)
            store.append([
                score_record(out, block, index=item.index, id=item.id, prompt=item.prompt,
                             prompt_tokens=item.prompt_tokens, continuation=item.continuation, extra=item.extra)
                for item, out in zip(chunk, outputs)
            ])
            bar.advance(len(chunk))
    finally:
        bar.finish()
    return len(pending)
