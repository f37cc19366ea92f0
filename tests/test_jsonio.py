"""Files are written whole or not at all (planner.jsonio.atomic_path), and read with one-line errors."""
import os

import pytest

from planner.jsonio import JsonFileError, atomic_path, read_json, write_json_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = str(tmp_path / "out.json")
    write_json_atomic(path, {"a": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            with open(tmp, "w") as f:
                f.write("{half")
            raise RuntimeError("interrupted")
    assert read_json(path) == {"a": 1}
    assert os.listdir(tmp_path) == ["out.json"]


def test_the_temporary_keeps_the_suffix_and_replaces_on_success(tmp_path):
    path = str(tmp_path / "sub" / "state.pt")
    with atomic_path(path) as tmp:
        assert tmp.endswith(".pt") and os.path.dirname(tmp) == os.path.dirname(path)  # same file system
        with open(tmp, "wb") as f:
            f.write(b"x")
    assert open(path, "rb").read() == b"x" and os.listdir(tmp_path / "sub") == ["state.pt"]


def test_json_without_inf_and_clear_read_errors(tmp_path):
    path = str(tmp_path / "x.json")
    write_json_atomic(path, {"t": float("inf"), "n": [1.5, float("nan")]})
    assert read_json(path) == {"t": None, "n": [1.5, None]}
    with pytest.raises(JsonFileError, match="does not exist"):
        read_json(str(tmp_path / "missing.json"), what="plan")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(JsonFileError, match="not valid JSON"):
        read_json(str(tmp_path / "bad.json"))
