"""Byte sizes as people write and read them: '16GiB' in, '1.50 GiB' out."""
from __future__ import annotations

import math
import re
from typing import Any

from planner.errors import UsageError

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


MAX_BYTES = 1e18

# the parameter dtypes a profile may be in, and their bytes per element
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def parse_bytes(text: str, option: str = "size", least: float = 1.0) -> float:
    """'16GiB' -> 17179869184; '512MiB', '1.5GB', '1e9' and plain byte counts work too; at least
    `least` bytes (a byte: a capacity or a rate; 0 where none is meant)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise UsageError(f"{option} {text!r} is not a size; write e.g. 16GiB, 512MiB, 2GB or a byte count")
    value = float(match.group(1)) * _UNITS[unit]
    if not least <= value <= MAX_BYTES:  # past an exabyte the solvers' arithmetic breaks
        raise UsageError(f"{option} must be {least:.0f} byte{'s' if least != 1 else ''} to {MAX_BYTES:.0e} (got {text!r})")
    return value


def size_value(value: Any, what: str) -> float:
    """A size (bytes, bytes/s) read from a file: a positive finite number or a string parse_bytes
    reads ("100MB"); anything else is a ValueError naming `what`."""
    if isinstance(value, str):
        try:
            number = parse_bytes(value, what)
        except UsageError as e:  # a file's value, not an option: a plain ValueError
            raise ValueError(str(e)) from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ValueError(f"{what} must be a number or a size such as \"100MB\" (got {value!r})")
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{what} must be positive (got {value!r})")
    if number > MAX_BYTES:  # as parse_bytes: past an exabyte the solvers' arithmetic breaks
        raise ValueError(f"{what} must be at most {MAX_BYTES:.0e} (got {value!r})")
    return number


def number_value(value: Any, what: str, positive: bool) -> float:
    """A plain number read from a file (a speed, a latency): finite, > 0 when `positive`, else >= 0;
    anything else is a ValueError naming `what`."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or \
            not (value > 0 if positive else value >= 0):
        raise ValueError(f"{what} must be a {'positive' if positive else 'non-negative'} number (got {value!r})")
    return float(value)


SPEEDS = (1e-3, 1e3)  # a device's speed relative to the profiled one: beyond these, a typo


def speed_value(value: Any, what: str) -> float:
    """A device speed relative to the profiled device (number_value), within SPEEDS."""
    speed = number_value(value, what, positive=True)
    if not SPEEDS[0] <= speed <= SPEEDS[1]:
        raise ValueError(f"{what} is relative to the profiled device, {SPEEDS[0]:g} to {SPEEDS[1]:g} (got {value!r})")
    return speed


def format_bytes(n: float) -> str:
    """Human units: '512 B', '12.0 KiB', '512.0 MiB', '1.50 GiB'."""
    n = float(n)
    if abs(n) < 1024:
        return f"{n:.0f} B"
    if abs(n) < 1024 ** 2:
        return f"{n / 1024:.1f} KiB"
    if abs(n) < 1024 ** 3:
        return f"{n / 1024 ** 2:.1f} MiB"
    return f"{n / 1024 ** 3:.2f} GiB"


MAX_LATENCY_S = 3600.0  # a link's latency: beyond an hour, a typo (the solvers' arithmetic needs bounds)
MIN_BANDWIDTH = 1e3  # bytes/s: below, a typo (a message would take longer than any run)


def latency_value(value: Any, what: str) -> float:
    """A link's latency read from a file: seconds, 0 to MAX_LATENCY_S."""
    latency = number_value(value, what, positive=False)
    if latency > MAX_LATENCY_S:
        raise ValueError(f"{what} is seconds per message, 0 to {MAX_LATENCY_S:g} (got {value!r})")
    return latency


def bandwidth_value(value: Any, what: str) -> float:
    """A link's bandwidth read from a file (size_value): at least MIN_BANDWIDTH bytes/s."""
    bandwidth = size_value(value, what)
    if bandwidth < MIN_BANDWIDTH:
        raise ValueError(f"{what} is bytes per second, at least {MIN_BANDWIDTH:g} (\"1KB\") (got {value!r})")
    return bandwidth
