"""Checks of values a user gives, shared by the Python API, the files it reads and the CLI's flags.

A value of the wrong type raises ArgumentTypeError (a TypeError); a value out of range raises the
caller's error class (a ValueError). Booleans are not integers here, and NaN or infinity is no number.
"""

from __future__ import annotations

import math
import os
import re

from .errors import ArgumentTypeError, ConfigError
from .units import parse_size

# torch.manual_seed takes up to 2**64 - 1; seeds stop at 2**63 - 1 so that a seed plus a sequence's
# index (the default per-sequence seed) stays in range.
MAX_SEED = 2**63 - 1

_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def in_range(value, minimum=None, maximum=None, above=None) -> bool:
    return ((minimum is None or value >= minimum) and (maximum is None or value <= maximum)
            and (above is None or value > above))


def requirement(noun: str, minimum=None, maximum=None, above=None) -> str:
    """E.g. "an integer >= 1", "a number in (0, 1]"."""
    low = f"({_text(above)}" if above is not None else f"[{_text(minimum)}" if minimum is not None else None
    if low is not None and maximum is not None:
        return f"{noun} in {low}, {_text(maximum)}]"
    if above is not None:
        return f"{noun} > {_text(above)}"
    if minimum is not None:
        return f"{noun} >= {_text(minimum)}"
    if maximum is not None:
        return f"{noun} <= {_text(maximum)}"
    return noun


def _text(bound) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def check_int(value, name: str, error: type[Exception], minimum=None, maximum=None) -> int:
    if not is_int(value):
        raise ArgumentTypeError(f"{name} must be {requirement('an integer', minimum, maximum)}, got {value!r}")
    if not in_range(value, minimum, maximum):
        raise error(f"{name} must be {requirement('an integer', minimum, maximum)}, got {value!r}")
    return value


def check_real(value, name: str, error: type[Exception], minimum=None, maximum=None, above=None) -> float:
    """A finite int or float in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be {requirement('a number', minimum, maximum, above)}, got {value!r}")
    if not math.isfinite(value):
        raise error(f"{name} must be {requirement('a finite number', minimum, maximum, above)}, got {value!r}")
    if not in_range(value, minimum, maximum, above):
        raise error(f"{name} must be {requirement('a number', minimum, maximum, above)}, got {value!r}")
    return value


def check_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be true or false, got {value!r}")
    return value


def check_size(value, name: str | None = None):
    """A positive size: text such as '16GiB', or a number of bytes. ``name`` leads the message."""
    what = f"{name} " if name else ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return check_real(value, name or "size", ConfigError, above=0)
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{what}must be a size such as '16GiB' or a number of bytes, got {value!r}")
    if parse_size(value) <= 0:
        raise ConfigError(f"{what}must be a positive size, got {value!r}")
    return value


def check_seed(value, name: str, error: type[Exception]) -> int:
    return check_int(value, name, error, 0, MAX_SEED)


def check_optional_path(value, name: str):
    """None, or a str or os.PathLike naming a file or folder."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__}")
    return value


def check_device_name(name: str) -> str:
    """auto, cpu, cuda or cuda:N: the devices flexoff computes on."""
    if not _DEVICE.fullmatch(name):
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")
    return name
