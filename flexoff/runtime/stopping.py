"""When a sequence stops: end-of-sequence ids, stop strings and its token budget, checked on token ids.

Stop strings are matched on text decoded one token at a time: each token decodes only a short window
of ids, and a tail of the text, one character shorter than the longest stop string, is kept so that a
stop string spanning token boundaries is still found. Whether it stops is what decoding the whole
sequence on every token and searching it would say.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .sampling import SamplingParams

Decode = Callable[[list[int]], str]


class IncrementalDecoder:
    """The text of a growing list of token ids, decoding a short window per token.

    The window starts at the first token decoded last time (or before it, if that decodes to nothing),
    so that the rules joining a token to the
    one before (spaces between words, a leading space dropped at the start) apply as they do in the
    whole text. A token ending within a character (byte-level vocabularies) leaves the window open
    until the character completes.
    """

    def __init__(self, decode: Decode):
        self.decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # the window's first token
        self._read = 0  # tokens whose text is committed

    def add(self, token: int) -> tuple[str, bool]:
        """Append ``token``; returns (the text of the tokens not yet committed, whether that text
        follows the committed text). When it does not (decoding is not prefix-stable there), it is
        the whole text instead."""
        self.ids.append(token)
        before = self.decode(self.ids[self._prefix:self._read])
        while not before and self._prefix > 0:  # tokens that decode to nothing (special ones) give no context
            self._prefix -= 1
            before = self.decode(self.ids[self._prefix:self._read])
        after = self.decode(self.ids[self._prefix:])
        if not after.startswith(before):
            self._prefix, self._read = len(self.ids) - 1, len(self.ids)
            return self.decode(self.ids), False
        pending = after[len(before):]
        if not pending.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
        return pending, True

    @property
    def complete(self) -> bool:
        """Whether the last text returned was committed (its characters are whole)."""
        return self._read == len(self.ids)


class StopStrings:
    """Finds the first of ``stops`` to appear in the decoded text, one token at a time."""

    def __init__(self, stops: Sequence[str], decode: Decode):
        self.stops = tuple(stops)
        self.decoder = IncrementalDecoder(decode)
        self.keep = max(len(s) for s in self.stops) - 1
        self.tail = ""  # the last ``keep`` characters of the committed text

    def add(self, token: int) -> str | None:
        """Append ``token``; the stop string that appears first in the text once one does, else None."""
        text, follows = self.decoder.add(token)
        # A stop string not found before ends in the new text: it starts at most ``keep`` characters back.
        window = self.tail + text if follows else text
        found = min(((window.find(stop), i) for i, stop in enumerate(self.stops) if stop in window), default=None)
        if self.decoder.complete:
            self.tail = window[max(0, len(window) - self.keep):]
        return None if found is None else self.stops[found[1]]


class StopCondition:
    """Why a sequence stops after each token it produces, if it does: "stop" (an end-of-sequence id,
    unless ignored, a stop token id or a stop string) or "length" (its budget spent). ``reason`` then
    holds the stop token id or stop string that ended it (None for end-of-sequence and "length"), as
    vLLM's ``stop_reason``."""

    def __init__(self, params: SamplingParams, eos_ids: Sequence[int], decode: Decode | None):
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.strings = StopStrings(params.stop, decode) if params.stop and decode is not None else None
        self.count = 0
        self.reason: int | str | None = None

    def add(self, token: int) -> str | None:
        self.count += 1
        # Before min_tokens nothing stops it (as vLLM): the sampler masks stop tokens meanwhile, and a
        # stop string found then is passed over (it ends before the text searched later).
        early = self.count < self.params.min_tokens
        if token in self.eos and not early:
            return "stop"
        if token in self.stop_ids and not early:
            self.reason = token
            return "stop"
        if self.strings is not None:
            found = self.strings.add(token)
            if found is not None and not early:
                self.reason = found
                return "stop"
        if self.count >= self.params.max_new_tokens:
            return "length"
        return None
