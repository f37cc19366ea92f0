"""`planner solve --precision --shard --reserve` (issue 25): the plan states them, bad values fail in one line,
and a run at another precision is refused."""
import json

import pytest

from planner.cli.main import main
from planner.jsonio import JsonFileError
from planner.plan.file import Plan, load_plan
from planner.profile.profile import load_profile, save_profile
from tests.support.runs import profile_of
from tests.support.synthetic import synthetic_profile


@pytest.fixture()
def profile_path(tmp_path):
    profile = synthetic_profile(forward=[1e-3] * 4, backward=[2e-3] * 4, params=[4000, 8000, 8000, 4000],
                                saved=[400] * 4, cut_act=[80] * 3, sizes=(1, 2))
    path = str(tmp_path / "profile.json")
    save_profile(profile, path)
    return path


def test_plan_states_precision_shard_and_reserve(profile_path, tmp_path, capsys):
    out = str(tmp_path / "plan.json")
    code = main(["solve", profile_path, "--devices", "4", "--global-batch", "8", "--optimizer", "adamw",
                 "--precision", "bf16-mixed", "--shard", "auto", "--reserve", "1KiB",
                 "--memory-per-device", "60000", "-o", out])
    assert code == 0, capsys.readouterr().err
    plan = load_plan(out)
    assert plan.precision == "bf16-mixed" and plan.reserve_bytes == 1024
    assert plan.shard in ("none", "optimizer", "gradients", "parameters")
    if plan.data_parallel == 1:
        assert plan.shard == "none"
    for st in plan.stages:
        assert st.memory_bytes["fixed"] >= 1024 and st.memory_bytes["device_total"] <= 60000
    with open(out) as f:
        raw = json.load(f)
    assert {"precision", "shard", "reserve_bytes"} <= set(raw)


@pytest.mark.parametrize("zero", ["0", "0B", "0GiB", "0.0"])
def test_a_zero_reserve_in_any_unit_is_none(profile_path, tmp_path, capsys, zero):
    out = str(tmp_path / "plan.json")
    assert main(["solve", profile_path, "--stages", "2", "--global-batch", "4", "--reserve", zero, "-o", out]) == 0, \
        capsys.readouterr().err
    assert load_plan(out).reserve_bytes == 0.0


def test_defaults_from_the_profile(profile_path, tmp_path, capsys):
    out = str(tmp_path / "plan.json")
    assert main(["solve", profile_path, "--stages", "2", "--global-batch", "4", "-o", out]) == 0
    plan = load_plan(out)
    assert (plan.precision, plan.shard, plan.reserve_bytes) == ("fp32", "none", 0.0)  # a CPU fp32 profile


@pytest.mark.parametrize("extra,needle", [
    (["--reserve", "lots"], "--reserve 'lots' is not a size"),
    (["--reserve=-1GiB"], "--reserve"),
])
def test_bad_values_fail_in_one_line(profile_path, tmp_path, capsys, extra, needle):
    out = tmp_path / "plan.json"
    code = main(["solve", profile_path, "--stages", "2", "--global-batch", "4", "-o", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_run_at_another_precision_is_refused(profile_path, tmp_path):
    out = str(tmp_path / "plan.json")
    assert main(["solve", profile_path, "--stages", "2", "--global-batch", "4", "--precision", "bf16-mixed",
                 "-o", out]) == 0
    plan = load_plan(out)
    assert plan.precision_mismatch("bf16-mixed") is None
    message = plan.precision_mismatch("fp32")
    assert "made for precision bf16-mixed" in message and "\n" not in message
    raw = plan.to_json()
    raw["precision"] = "fp8"
    with pytest.raises(JsonFileError, match="precision 'fp8'"):
        Plan.from_json(raw)


@pytest.mark.parametrize("flags, says", [(["--precision", "bf16"], "precision bf16"),
                                         (["--shard", "parameters", "--precision", "bf16-mixed"],
                                          "sharding parameters"),
                                         (["--shard", "parameters", "--schedule", "zb-h1"], "zero-bubble"),
                                         (["--shard", "parameters"], None)])
def test_a_plan_the_runtime_does_not_run_is_written_with_a_note(profile_path, tmp_path, capsys, flags, says):
    # planned all the same (pure bf16, ZeRO-3 under bf16-mixed: what large models train with), and
    # `runtime execute` refuses it in one line: the solve says so where it writes it
    out = str(tmp_path / "plan.json")
    code = main(["solve", profile_path, "--devices", "2", "--global-batch", "8", *flags, "-o", out])
    err = capsys.readouterr().err
    assert code == 0, err
    notes = [line for line in err.splitlines() if "`runtime execute` does not run this plan" in line]
    assert (len(notes) == 1 and says in notes[0] and "re-plan" in notes[0]) if says else not notes


def test_a_unit_passing_on_a_parameter_view_is_said_where_parameters_are_sharded(tmp_path, capsys):
    """A learned latent array expanded to the batch and read by the next unit (a Perceiver): the profile
    marks the unit; `--shard parameters` is planned with a note naming it, `--shard auto` does not choose it."""
    profile = profile_of("tests.capture_models:latents", {}, sizes=(2,))
    assert [u.parameter_view for u in profile.units] == [True] + [False] * (len(profile.units) - 1)
    path = str(tmp_path / "profile.json")
    save_profile(profile, path)
    assert load_profile(path).units[0].parameter_view
    out = str(tmp_path / "plan.json")
    for shard, noted in (("parameters", True), ("gradients", False)):
        assert main(["solve", path, "--devices", "2", "--global-batch", "8", "--shard", shard,
                     "-o", out]) == 0
        notes = [line for line in capsys.readouterr().err.splitlines() if "does not run this plan" in line]
        assert load_plan(out).data_parallel == 2  # the two devices as data-parallel replicas (the faster here)
        assert bool(notes) == noted and (not noted or "unit 'inp' passes on a view of its own parameter" in notes[0])
