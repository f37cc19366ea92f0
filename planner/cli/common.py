"""Option parsing and error handling shared by the `planner` and `runtime` commands."""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import List, Tuple, Type

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class UsageError(ValueError):
    """A bad option value; the message says what is expected."""


def parse_bytes(text: str, option: str = "size") -> float:
    """'16GiB' -> 17179869184; '512MiB', '1.5GB', '1e9' and plain byte counts work too."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise UsageError(f"{option} {text!r} is not a size; write e.g. 16GiB, 512MiB, 2GB or a byte count")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise UsageError(f"{option} must be positive (got {text!r})")
    return value


def parse_sizes(text: str) -> List[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise UsageError(f"--micro-batch-sizes {text!r} must be comma-separated integers, e.g. 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise UsageError("--micro-batch-sizes needs positive integers, e.g. 1,2,4")
    return sizes




def run_subcommand(args: argparse.Namespace, user_errors: Tuple[Type[BaseException], ...], interrupted: str) -> int:
    """`args.func(args)`, with the user's mistakes (`user_errors`) as one line on stderr and exit
    code 2, never a traceback (PLANNER_TRACEBACK=1 shows it), and Ctrl-C as `interrupted` and exit code 130."""
    try:
        return args.func(args)
    except user_errors as e:
        if os.environ.get("PLANNER_TRACEBACK"):  # for a bug report: the whole stack
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
