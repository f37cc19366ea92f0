"""A plan file's fields as JSON: what each field's value must be (the kinds below), every field read
from its key with its kind checked (other keys kept as `extra`), and written back in order."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any, Dict, Tuple

from planner.jsonio import JsonFileError

REMAKE = "re-create it with `planner solve PROFILE`"

# What a field's JSON value must be: (check, what the message says was expected)
INT = (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
NUMBER = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
NUMBER_OR_NULL = (lambda v: v is None or NUMBER[0](v), "a number or null")
TEXT = (lambda v: isinstance(v, str), "a string")
OBJECT = (lambda v: isinstance(v, dict), "an object")
NAMES = (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of names")
INTS = (lambda v: isinstance(v, list) and all(INT[0](x) for x in v), "a list of integers")
INT_ROWS = (lambda v: isinstance(v, list) and all(INTS[0](row) for row in v), "a list of lists of integers")
NUMBERS = (lambda v: isinstance(v, list) and all(NUMBER[0](x) for x in v), "a list of numbers")
VALUES = (lambda v: isinstance(v, list) and all(isinstance(x, dict) and isinstance(x.get("name"), str) and
                                                x.get("kind") in ("tensor", "constant") for x in v),
          "a list of values ({name, kind: tensor|constant, ...})")


def valid_shape(v: Any) -> bool:
    """A message tensor's shape: sizes >= 0, at most 2**40 elements."""
    return INTS[0](v) and all(n >= 0 for n in v) and math.prod(v) <= 1 << 40


def json_field(kind: Tuple, required: bool = True, **kwargs) -> Any:
    """A dataclass field written under its name, its value of `kind` (one of the above; None: unchecked)."""
    return field(metadata={"json": kind, "required": required}, **kwargs)


def not_an_object(where: str):
    raise JsonFileError(f"{where} is not an object; {REMAKE}")


def fields_from_json(cls, d: Dict[str, Any], where: str) -> Dict[str, Any]:
    """The dataclass's fields from their keys: every required key present, every value of its type;
    other keys go to `extra`."""
    known = [f for f in dataclasses.fields(cls) if "json" in f.metadata]
    missing = [f.name for f in known if f.metadata["required"] and f.name not in d]
    if missing:
        raise JsonFileError(f"{where} lacks {', '.join(missing)}; {REMAKE}")
    values: Dict[str, Any] = {}
    for f in known:
        if f.name not in d:
            continue
        check = f.metadata["json"]
        if check is not None and not check[0](d[f.name]):
            raise JsonFileError(f"{where} has {f.name} {d[f.name]!r}, expected {check[1]}; {REMAKE}")
        values[f.name] = d[f.name]
    names = {f.name for f in known}
    values["extra"] = {k: v for k, v in d.items() if k not in names}
    return values


def fields_to_json(obj: Any) -> Dict[str, Any]:
    """Every field under its key, in order; optional fields that are unset (None) are left out
    (`memory_per_device_bytes` and the like, required and nullable, are written as null)."""
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if "json" not in f.metadata:
            continue
        value = getattr(obj, f.name)
        if value is None and not f.metadata["required"] and f.metadata["json"] is not NUMBER_OR_NULL:
            continue
        out[f.name] = value
    out.update(obj.extra)
    return out
