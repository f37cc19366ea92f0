"""Reading and writing the project's JSON files: clear errors in, atomic writes out."""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any


class JsonFileError(ValueError):
    """A user file is missing, unreadable or not what it should be. The message says what to do."""


def read_json(path: str, what: str = "file") -> Any:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise JsonFileError(f"{what} {path!r} does not exist") from None
    except IsADirectoryError:
        raise JsonFileError(f"{what} {path!r} is a directory, expected a JSON file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JsonFileError(f"{what} {path!r} is not valid JSON ({e})") from None


def _clean(obj: Any) -> Any:
    """JSON has no inf/nan: write them as null rather than producing an unreadable file."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json_atomic(path: str, obj: Any) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(_clean(obj), f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
