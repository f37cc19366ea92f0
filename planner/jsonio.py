"""Reading and writing the project's files: JSON read with clear errors, every file written atomically."""
from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from typing import Any, Dict, Iterable, Iterator, Optional, Sequence


class JsonFileError(ValueError):
    """A user file is missing, unreadable or not what it should be. The message says what to do."""


def read_json(path: str, what: str = "file") -> Any:
    try:
        kind = _not_a_file(os.stat(path).st_mode)  # a FIFO would block the read, a device may never end
        if kind:
            raise JsonFileError(f"{what} {path!r} is {kind}, expected a JSON file")
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise JsonFileError(f"{what} {path!r} does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JsonFileError(f"{what} {path!r} is not valid JSON ({e})") from None
    except RecursionError:
        raise JsonFileError(f"{what} {path!r} nests its JSON too deeply to be one of this project's files") from None
    except OSError as e:
        raise JsonFileError(f"{what} {path!r} cannot be read: {e.strerror or e}") from None


def newer_schema(version: Any, expected: int) -> str:
    """The words for a file whose schema_version is above the one this code reads (a newer release
    wrote it): remaking it would lose work that upgrading keeps. Empty for any other version."""
    if isinstance(version, int) and not isinstance(version, bool) and version > expected:
        return (f"a newer pipeplanner wrote it (schema_version {version}; this one reads {expected}): upgrade "
                "(pip install -U pipeplanner), or ")
    return ""


def refuse_unknown_keys(d: Dict[str, Any], known: Iterable[str], where: str) -> None:
    """A ValueError naming the keys of `d` not in `known`: a misspelt key (\"memroy\") read as absent
    would silently drop what it sets, a memory cap included."""
    extra = sorted(set(d) - set(known))
    if extra:
        raise ValueError(f"{where} has unknown key(s) {', '.join(extra)}; known: {', '.join(sorted(known))}")


def not_a_regular_file(path: str) -> str:
    """What `path` is when it exists and is not a regular file ("a directory", "not a regular file": a
    FIFO or a device, whose read may block or never end), else ""."""
    try:
        return _not_a_file(os.stat(path).st_mode)
    except OSError:
        return ""


def _not_a_file(mode: int) -> str:
    """What a path of this stat mode is when it is not a regular file ("" when it is)."""
    if stat.S_ISREG(mode):
        return ""
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file"


def _clean(obj: Any) -> Any:
    """JSON has no inf/nan: write them as null rather than producing an unreadable file."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask sets it to read it: a race with other threads)
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0)
        os.umask(mask)
        return mask


def image_format(path: str, option: str) -> str:
    """The picture format `path` names by its suffix ("png" where it has none), one matplotlib writes:
    JsonFileError, one line, otherwise -- before the work. Its savefig is given it: a path without a suffix
    made matplotlib add ".png" to atomic_path's temporary file, and the empty file was renamed onto `path`."""
    suffix = os.path.splitext(path)[1][1:].lower()
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:  # the drawing says what to install
        return suffix or "png"
    known = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in known:
        raise JsonFileError(f"{option} {path!r}: matplotlib writes no .{suffix} picture; name a .png file (or "
                            f"{', '.join('.' + k for k in sorted(known) if k != 'png')})")
    return suffix or "png"


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary path beside `path` (same suffix) to write the file to; renamed onto `path` when
    the block ends, removed if it raises. Readers never see half a file, and a failed write leaves
    none. Every file the project writes whole goes through here (logs are streamed)."""
    check_writable(path, make_folder=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1],
                                   dir=os.path.dirname(os.path.abspath(path)))
    except OSError as e:
        raise JsonFileError(f"cannot write {path!r}: {e.strerror or e}") from None
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # as open() would make it (mkstemp's is 0600: unreadable to others)
        yield tmp
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise JsonFileError(f"cannot write {path!r}: {e.strerror or e}") from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_writable(path: str, inputs: Sequence[Optional[str]] = (), make_folder: bool = False) -> None:
    """That a file can be written at `path` (its folder can be made where missing; `make_folder`, for a
    caller that writes at once, makes it and leaves the test of a new file there to that write):
    JsonFileError, one line, otherwise -- before the work that produces it, where that is
    long (a run that then fails leaves no new folder). A path that names something other than a file
    (a folder, /dev/null) is refused: the rename would replace it; so is one of the command's
    `inputs` (it would be lost)."""
    if not path:
        raise JsonFileError("an output path is empty; name a file to write")
    for given in inputs:
        if given and (os.path.abspath(path) == os.path.abspath(given) or
                      os.path.exists(path) and os.path.exists(given) and os.path.samefile(path, given)):
            raise JsonFileError(f"output {path!r} is also {given!r}, which this command reads or writes: one "
                                "would be lost; name another output")
    if len(os.path.basename(path).encode()) > 255:
        raise JsonFileError(f"cannot write {path!r}: its name is too long")
    try:
        kind = _not_a_file(os.stat(path).st_mode)
    except OSError:  # nothing there yet (or a link to nothing), or no folder to hold it: said below
        kind = "not a regular file" if os.path.islink(path) else ""
    if kind:
        raise JsonFileError(f"output {path!r} is {kind}; name a file to write")
    directory = os.path.dirname(os.path.abspath(path))
    existing = directory
    while not os.path.exists(existing):  # the folder that would hold the ones to make
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise JsonFileError(f"cannot write {path!r}: {existing!r} is a file, not a folder")
    if make_folder:  # the caller writes there now (atomic_path's own temporary file is the probe)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise JsonFileError(f"cannot write {path!r}: {e.strerror or e} (its folder {directory!r})") from None
        return
    probe = directory if os.path.isdir(directory) else existing
    try:  # a file made there and removed: access() says yes to root in /proc, where nothing can be made
        fd, made = tempfile.mkstemp(prefix=".probe-", dir=probe)
        os.close(fd)
        os.unlink(made)
    except OSError as e:
        raise JsonFileError(f"cannot write {path!r}: its folder {probe!r} takes no new file "
                            f"({e.strerror or e})") from None


def write_json_atomic(path: str, obj: Any) -> None:
    """Write `obj` as JSON (inf and nan as null), atomically (`atomic_path`)."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(_clean(obj), f, indent=1, allow_nan=False)
            f.write("\n")
