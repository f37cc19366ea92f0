"""Reading a profile file's JSON values: the rules every field is checked against (`Reader`), each
bad value named by its path in the file, and the helpers its records write and show values with.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Dict, List

from planner.jsonio import JsonFileError
from planner.sizes import MAX_BYTES

MAX_SECONDS = 1e6  # a time past this (11 days a unit) is a broken file; the solvers' arithmetic needs bounds


def str_keys(d: Dict[int, Any]) -> Dict[str, Any]:
    return {str(k): v for k, v in sorted(d.items())}


def show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."



def _as_float(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf



class Reader:
    """Reads a profile's JSON values, naming the first bad one by its path in the file.

    Rules: times are finite numbers of seconds >= 0, byte counts finite numbers >= 0, every unit
    and every cut value has an entry at every listed micro-batch size, cut k sits before unit k.
    """

    def __init__(self, source: str, sizes: List[int]):
        self.source = source  # "profile 'path'" or "profile"
        self.sizes = sizes

    def error(self, where: str, problem: str) -> JsonFileError:
        return JsonFileError(f"{self.source}: {where} {problem}; re-run `planner profile`")

    def number(self, value: Any, where: str, rule: str, most: float = math.inf) -> float:
        number = _as_float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        if not (math.isfinite(number) and 0 <= number <= most):  # NaN, inf and an int no float holds fail too
            raise self.error(where, f"is {show(value)}: {rule}")
        return number

    def seconds(self, value: Any, where: str) -> float:
        return self.number(value, where, f"times must be finite, >= 0 and at most {MAX_SECONDS:.0e}", MAX_SECONDS)

    def count(self, value: Any, where: str, what: str = "byte counts") -> int:
        """A whole number >= 0 (a fraction is refused: 0.5 bytes read as 0 before)."""
        rule = f"{what} must be whole numbers >= 0 and at most {MAX_BYTES:.0e}"
        number = self.number(value, where, rule, MAX_BYTES)
        if number != int(number):
            raise self.error(where, f"is {show(value)}: {rule}")
        return int(number)

    def named_counts(self, d: Any, where: str) -> Dict[str, int]:
        """{value name: bytes}, each a count."""
        return {str(k): self.count(n, f'{where}["{k}"]') for k, n in self.table(d, where).items()}

    def signed_counts(self, d: Any, where: str) -> Dict[str, int]:
        """{key: bytes more or fewer}, each a whole number of bytes."""
        out = {}
        for k, n in self.table(d, where).items():
            magnitude = self.count(abs(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else n,
                                   f'{where}["{k}"]')
            out[str(k)] = -magnitude if n < 0 else magnitude
        return out

    def table(self, d: Any, where: str) -> Dict[str, Any]:
        if not isinstance(d, dict):
            raise self.error(where, f"is {show(d)}: expected an object")
        return d

    def per_size(self, d: Any, where: str, read: Callable[[Any, str], Any], required: bool = True) -> Dict[int, Any]:
        """{micro-batch size: read(value)}; every listed size must be there when `required` (others
        may hold some sizes: stage_overhead_s lacks those the whole model was not timed at)."""
        out: Dict[int, Any] = {}
        for key, value in self.table(d, where).items():
            try:
                b = int(key)
            except ValueError:
                raise self.error(where, f"has key {show(key)}: keys are micro-batch sizes") from None
            out[b] = read(value, f'{where}["{key}"]')
        missing = [b for b in self.sizes if b not in out]
        if missing and required:
            raise self.error(where, f"has no entry for micro-batch size {missing[0]} (micro_batch_sizes lists it)")
        return out

