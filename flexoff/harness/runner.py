"""Drive the API over many requests, appending results to a ResultStore as blocks finish.

Requests whose id is already in the store are skipped, so calling these again after a crash
finishes the rest. Sampling seeds come from the request id, never from a request's position in
the list, so a resumed job draws the same tokens as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from tqdm import tqdm

from ..runtime.metrics import Metrics
from ..runtime.sampling import SamplingParams
from .store import ResultStore, id_key


def request_seed(base_seed: int, request_id, sample: int = 0) -> int:
    """A per-request sampling seed that depends only on the job seed and the request's id."""
    digest = hashlib.sha256(f"{base_seed}\x00{id_key(request_id)}\x00{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class GenerationItem:
    id: object  # the id written to the record (a string or an integer)
    prompt: str | list[int]
    params: SamplingParams
    extra: dict = field(default_factory=dict)  # extra fields copied into the record


@dataclass
class ScoreItem:
    id: object
    prompt: str | list[int]
    continuation: str | list[int]
    extra: dict = field(default_factory=dict)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_generation(llm, store: ResultStore, items: list[GenerationItem], *, progress: bool = True,
                   desc: str = "prompts") -> Metrics | None:
    """Generate for every item not yet in ``store``; None when there was nothing left to do."""
    pending = [item for item in items if id_key(item.id) not in store.done]
    if not pending:
        return None
    bar = tqdm(total=len(items), initial=len(items) - len(pending), unit="prompt", desc=desc,
               disable=not progress, dynamic_ncols=True, file=sys.stderr)
    started = time.perf_counter()
    generated = [0]

    def on_block(outputs, metrics: Metrics) -> None:
        finished_at = _now()
        records = []
        for out in outputs:
            item = pending[out.index]
            records.append({
                "id": item.id, "text": out.text, "token_ids": list(out.token_ids), "logprobs": list(out.logprobs),
                "finish_reason": out.finish_reason, "prompt_tokens": len(out.prompt_token_ids),
                "generated_tokens": len(out.token_ids), "block_size": len(outputs),
                "block_seconds": round(metrics.total_time, 6), "finished_at": finished_at, **item.extra,
            })
        store.append(records)
        generated[0] += metrics.generated_tokens
        bar.update(len(outputs))
        bar.set_postfix_str(f"{generated[0] / max(time.perf_counter() - started, 1e-9):.1f} tok/s")

    try:
        result = llm.generate([item.prompt for item in pending], [item.params for item in pending],
                              on_block=on_block)
    finally:
        bar.close()
    return result.metrics


def run_scoring(llm, store: ResultStore, items: list[ScoreItem], *, chunk_size: int = 256,
                progress: bool = True, desc: str = "scoring") -> int:
    """Score every item not yet in ``store``, a chunk at a time; returns how many were scored."""
    pending = [item for item in items if id_key(item.id) not in store.done]
    # Like lengths together, so each chunk's blocks carry little padding.
    pending.sort(key=lambda item: len(item.prompt) + len(item.continuation))
    bar = tqdm(total=len(items), initial=len(items) - len(pending), unit="seq", desc=desc,
               disable=not progress or not pending, dynamic_ncols=True, file=sys.stderr)
    try:
        for start in range(0, len(pending), chunk_size):
            chunk = pending[start:start + chunk_size]
            outputs = llm.score([item.prompt for item in chunk], [item.continuation for item in chunk])
            finished_at = _now()
            store.append([
                {"id": item.id, "kind": "score", "token_ids": list(out.token_ids), "logprobs": list(out.logprobs),
                 "finished_at": finished_at, **item.extra}
                for item, out in zip(chunk, outputs)
            ])
            bar.update(len(chunk))
    finally:
        bar.close()
    return len(pending)
