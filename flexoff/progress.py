"""How far a generation is, in new tokens, and how long it has left, prefill included.

A block's prefill produces only its first token per sequence but can take as long as many decode
steps, so a time left read from the token rate alone (tqdm's) is short by every prefill still to
come. ``TokenProgress`` measures the two phases apart, seconds per prompt token in prefill and per
new token in decode, and adds the prompt tokens and new tokens still to go at each rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# tqdm's layout with tqdm's own time left (from the token rate) replaced by ours, in the postfix.
TOKEN_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tok [{elapsed}{postfix}]"


class TokenProgress:
    """Events of one generation job, and the time left they imply. ``prompt_tokens`` and
    ``new_tokens`` are the job's whole work (its prompts' tokens, its generation budgets)."""

    def __init__(self, prompt_tokens: int, new_tokens: int, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.prompt_left = prompt_tokens
        self.new_total = new_tokens
        self.new_done = 0  # generated, or budget left unused by sequences that stopped early
        self.started = clock()
        self._block_start = self._block_prompt = self._decode_start = None
        self.prefill_seconds = self.prefill_tokens = 0.0
        self.decode_seconds = self.decode_tokens = 0.0

    def block_started(self, prompt_tokens: int) -> None:
        self._block_start, self._block_prompt, self._decode_start = self.clock(), prompt_tokens, None

    def prefilled(self) -> None:
        """The block's prefill is done (its first tokens were counted by ``generated`` before)."""
        now = self.clock()
        self.prefill_seconds += now - self._block_start
        self.prefill_tokens += self._block_prompt
        self.prompt_left -= self._block_prompt
        self._decode_start = now

    def generated(self, count: int) -> None:
        self.new_done += count
        if self._decode_start is not None:
            now = self.clock()
            self.decode_seconds += now - self._decode_start
            self.decode_tokens += count
            self._decode_start = now

    def block_done(self, unused: int) -> None:
        """The block ended; ``unused``: its budget that sequences stopping early did not need."""
        self.new_done += unused
        self._decode_start = None

    def remaining(self) -> float | None:
        """Seconds left, once both phases have been timed; None before."""
        if not self.prefill_tokens or not self.decode_tokens:
            return None
        prefill = max(self.prompt_left, 0) * self.prefill_seconds / self.prefill_tokens
        return prefill + max(self.new_total - self.new_done, 0) * self.decode_seconds / self.decode_tokens

    def note(self) -> str:
        """The bar's postfix: time left and the token rate so far."""
        left = self.remaining()
        elapsed = max(self.clock() - self.started, 1e-9)
        return f"{format_seconds(left) if left is not None else '?'} left, {self.new_done / elapsed:.1f} tok/s"


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


class TokenTracker:
    """LLM.generate's progress events (its ``tracker``), kept in a TokenProgress; a subclass shows
    them in ``show``, told how many new tokens to advance by."""

    clock: Callable[[], float] = staticmethod(time.perf_counter)
    progress: TokenProgress | None = None

    def start(self, prompt_tokens: int, new_tokens: int) -> None:
        self.progress = TokenProgress(prompt_tokens, new_tokens, self.clock)

    def block_started(self, prompt_tokens: int) -> None:
        self.progress.block_started(prompt_tokens)

    def prefilled(self) -> None:
        self.progress.prefilled()
        self.show(0)

    def generated(self, count: int) -> None:
        self.progress.generated(count)
        self.show(count)

    def block_done(self, unused: int) -> None:
        self.progress.block_done(unused)
        self.show(unused)

    def show(self, advance: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TokenBar(TokenTracker):
    """A tqdm bar on stderr over a generation's new tokens, with TokenProgress's time left in its
    note. ``enabled`` false: silent."""

    def __init__(self, desc: str = "generating", enabled: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        self.desc, self.enabled, self.clock = desc, enabled, clock
        self.bar = None

    def start(self, prompt_tokens: int, new_tokens: int) -> None:
        import sys

        from tqdm import tqdm

        super().start(prompt_tokens, new_tokens)
        self.bar = tqdm(total=new_tokens, desc=self.desc, disable=not self.enabled, bar_format=TOKEN_BAR_FORMAT,
                        dynamic_ncols=True, file=sys.stderr)

    def show(self, advance: int) -> None:
        self.bar.set_postfix_str(self.progress.note(), refresh=False)
        self.bar.update(advance)
        if not advance:
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
