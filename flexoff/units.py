"""Parsing and printing of byte sizes such as ``16GiB`` or ``1.5TB``."""

import re

from .errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Return the number of bytes in ``text`` ("16GiB", "1.5TB", "512MB", "1e9" is not accepted)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"size {text!r} is negative")
        return int(text)
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot parse size {text!r}: use a number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 16GiB or 1.5TB"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value > 2**63:  # also catches the infinity of a number too long for a float
        raise ConfigError(f"size {text!r} is too large")
    return int(value)


def format_size(num_bytes: float) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
