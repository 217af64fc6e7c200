"""Byte sizes and durations, parsed and printed one way everywhere.

Every size in a manifest, on the command line or in a table goes through ``parse_size`` and
``format_size``; nothing else in deploykit parses units. Never imports torch.
"""

from __future__ import annotations

import math
import re

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
# Matched with ``fullmatch`` on text already stripped and at most MAX_UNIT_TEXT long: a pattern that
# begins and ends with ``\s*`` backtracks quadratically over a run of spaces before a stray character
# ("1" + 200,000 spaces + "#" took 110 s), and one whitespace run between two tokens cannot.
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)?")
MAX_UNIT_TEXT = 64  # "1.5 GiB" is 7 characters; longer text is refused before any regex sees it
MAX_SIZE = 1 << 60  # 1 EiB: more than any device or disk; larger sizes are typing mistakes or attacks
MIN_DURATION = 0.001  # 1 ms: a duration is recorded in whole milliseconds below a second ('500ms')
MAX_DURATION = 366 * 86400.0  # a year: a longer wait is a mistake ('forever' says so where it is meant)

SIZE_UNITS_TEXT = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, or a plain integer of bytes"


def parse_size(value: object) -> int:
    """``"2GiB"`` -> 2147483648. Accepts an int (bytes) or a string with a unit. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '2GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return _size_within(value, value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as '2GiB', got {value!r}")
    match = _SIZE_RE.fullmatch(_bounded(value, "size"))
    if not match:
        raise ValueError(f"cannot read {value!r} as a size; use {SIZE_UNITS_TEXT}")
    number, unit = match.groups()
    factor = _SIZE_UNITS.get(unit.upper())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}; use {SIZE_UNITS_TEXT}")
    if not unit and "." in number:
        raise ValueError(f"a size in bytes must be a whole number, got {value!r}")
    return _size_within(int(round(float(number) * factor)), value)


def _size_within(size: int, value: object) -> int:
    if size > MAX_SIZE:
        raise ValueError(f"a size is at most {MAX_SIZE} bytes (1 EiB), got {_short(value)}")
    return size


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= MAX_UNIT_TEXT else f"{text[:MAX_UNIT_TEXT]}... ({len(text)} characters)"


def _bounded(value: str, what: str) -> str:
    """``value`` without surrounding whitespace; a ValueError when it is longer than any size or
    duration is, so no regex ever runs over a long string."""
    if len(value) > MAX_UNIT_TEXT:
        raise ValueError(f"a {what} is at most {MAX_UNIT_TEXT} characters, got {len(value)}")
    return value.strip()


def format_size(n: float) -> str:
    """Bytes as a short binary-unit string: 1536 -> '1.5 KiB', 3 -> '3 B'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1024
    return f"{n:.1f} TiB".replace(".0 ", " ")


def parse_duration(value: object) -> float:
    """``"120s"`` -> 120.0 seconds; ``"2m"``, ``"500ms"``, ``"1h"``, or a plain number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as '120s', got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value) if isinstance(value, float) or abs(value) <= MAX_DURATION else math.inf
    elif isinstance(value, str) and (match := _DURATION_RE.fullmatch(_bounded(value, "duration"))):
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
    else:
        raise ValueError(f"cannot read {value!r} as a duration; use e.g. '500ms', '120s', '2m', '1h'")
    if not math.isfinite(seconds) or seconds > MAX_DURATION:  # .inf, .nan, 10**400
        raise ValueError(f"a duration is at most {MAX_DURATION / 86400:g} days, got {_short(value)}")
    if seconds < MIN_DURATION:
        raise ValueError(f"a duration must be at least 1ms, got {_short(value)}")
    return seconds


def format_duration(seconds: float) -> str:
    """A duration as ``parse_duration`` reads it back: '500ms', '90s', '5m'."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:g}s"
    return f"{seconds / 60:g}m"
