"""Reading and writing the project's files: JSON read with clear errors, every file written atomically."""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from typing import Any, Iterator


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


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary path beside `path` (same suffix) to write the file to; renamed onto `path` when
    the block ends, removed if it raises. Readers never see half a file, and a failed write leaves
    none. Every file the project writes whole goes through here (logs are streamed)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=directory)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json_atomic(path: str, obj: Any) -> None:
    """Write `obj` as JSON (inf and nan as null), atomically (`atomic_path`)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(_clean(obj), f, indent=1, allow_nan=False)
            f.write("\n")
