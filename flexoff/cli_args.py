"""Flag types that check values at parse time, and a parser whose errors are one line.

Each type turns a flag's text into its value or refuses it with the rule it breaks; argparse adds
the flag's name ("argument --top-p: must be a number in (0, 1], got 1.5").
"""

from __future__ import annotations

import argparse
import math

from .checks import MAX_SEED, check_device_name, in_range, requirement
from .errors import FlexoffError
from .units import parse_size


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, ``flexoff: error: ...``, and exit code 2
    (argparse's own print the usage first). Subcommand parsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"flexoff: error: {message} (see `{self.prog} --help`)\n")


def integer(minimum: int | None = None, maximum: int | None = None):
    need = requirement("an integer", minimum, maximum)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {need}, got {text!r}") from None
        if not in_range(value, minimum, maximum):
            raise argparse.ArgumentTypeError(f"must be {need}, got {value}")
        return value

    return parse


def number(minimum: float | None = None, maximum: float | None = None, above: float | None = None):
    """A finite float in range (NaN and infinity are refused)."""
    need = requirement("a number", minimum, maximum, above)

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {need}, got {text!r}") from None
        if not math.isfinite(value) or not in_range(value, minimum, maximum, above):
            raise argparse.ArgumentTypeError(f"must be {need}, got {text}")
        return value

    return parse


def _checked(check):
    """A flag type from a check that raises FlexoffError; the check returns the flag's value."""

    def parse(text: str):
        try:
            return check(text)
        except FlexoffError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _size(text: str) -> str:
    if parse_size(text) <= 0:
        raise FlexoffError(f"must be a positive size, got {text!r}")
    return text  # consumers parse it again, as they parse sizes given in Python


def _text(text: str) -> str:
    if not text:
        raise FlexoffError("must not be empty")
    return text


def _dtype(text: str) -> str:
    import torch

    from .api import resolve_dtype

    resolve_dtype(text, torch.device("cpu"))
    return text


COUNT = integer(1)  # a positive count: prompts, tokens, batch sizes, instances
SEED = integer(0, MAX_SEED)
SIZE = _checked(_size)
NONEMPTY = _checked(_text)
DEVICE = _checked(check_device_name)
DTYPE = _checked(_dtype)
