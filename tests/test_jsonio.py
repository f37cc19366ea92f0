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


def test_a_written_file_has_the_mode_open_gives_it(tmp_path):
    # plans and profiles are read by other users' jobs: not mkstemp's 0600
    before = os.umask(0o022)
    try:
        write_json_atomic(str(tmp_path / "a.json"), {})
        os.umask(0o077)
        write_json_atomic(str(tmp_path / "b.json"), {})
    finally:
        os.umask(before)
    assert os.stat(tmp_path / "a.json").st_mode & 0o777 == 0o644
    assert os.stat(tmp_path / "b.json").st_mode & 0o777 == 0o600


def test_json_without_inf_and_clear_read_errors(tmp_path):
    path = str(tmp_path / "x.json")
    write_json_atomic(path, {"t": float("inf"), "n": [1.5, float("nan")]})
    assert read_json(path) == {"t": None, "n": [1.5, None]}
    with pytest.raises(JsonFileError, match="does not exist"):
        read_json(str(tmp_path / "missing.json"), what="plan")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(JsonFileError, match="not valid JSON"):
        read_json(str(tmp_path / "bad.json"))


def test_reading_something_other_than_a_file_is_one_line_not_a_hang(tmp_path):
    fifo = str(tmp_path / "pipe.json")
    os.mkfifo(fifo)  # opening it to read would wait for a writer forever
    with pytest.raises(JsonFileError, match="is not a regular file"):
        read_json(fifo, what="plan")
    with pytest.raises(JsonFileError, match="is a directory"):
        read_json(str(tmp_path), what="plan")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200000 + "]" * 200000)
    with pytest.raises(JsonFileError, match="nests its JSON too deeply"):
        read_json(str(deep))


def test_an_output_path_is_checked_and_never_replaces_a_folder_or_device(tmp_path):
    from planner.jsonio import check_writable

    for path, needle in (("", "empty"), (str(tmp_path), "is a directory"), (os.devnull, "not a regular file"),
                         (str(tmp_path / ("x" * 300)), "name is too long")):
        with pytest.raises(JsonFileError, match=needle):
            check_writable(path)
        with pytest.raises(JsonFileError, match=needle):
            write_json_atomic(path, {"a": 1})
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)
    (tmp_path / "file").write_text("x")
    with pytest.raises(JsonFileError, match="cannot write .* is a file, not a folder"):  # a file where a folder is
        write_json_atomic(str(tmp_path / "file" / "out.json"), {"a": 1})
    check_writable(str(tmp_path / "new" / "deeper" / "out.json"))  # a missing folder can be made: not made yet
    assert not os.path.exists(tmp_path / "new")  # (a run that fails after the check leaves none)
    write_json_atomic(str(tmp_path / "new" / "deeper" / "out.json"), {"a": 1})
    if os.path.isdir("/proc"):  # writable to root by access(), yet no file can be made: refused before the run
        with pytest.raises(JsonFileError, match="takes no new file"):
            check_writable("/proc/trace.json")
    assert os.path.isfile(tmp_path / "new" / "deeper" / "out.json")


def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path):
    """`planner solve p.json -o p.json` replaced the profile with the plan, and `runtime execute
    --report plan.json` the plan with the report (a fuzz of every command)."""
    from planner.jsonio import check_writable

    given = tmp_path / "in.json"
    given.write_text("{}")
    for path in (str(given), str(tmp_path / "." / "in.json")):
        with pytest.raises(JsonFileError, match="is also .* which this command reads or writes"):
            check_writable(path, [str(given)])
    os.link(given, tmp_path / "hard.json")  # the same file under another name
    with pytest.raises(JsonFileError, match="is also"):
        check_writable(str(tmp_path / "hard.json"), [str(given)])
    with pytest.raises(JsonFileError, match="is also"):  # two outputs, neither written yet
        check_writable(str(tmp_path / "out.json"), [None, str(tmp_path / "out.json")])
    check_writable(str(tmp_path / "out.json"), [str(given), None])
    assert given.read_text() == "{}"
