"""The plan file: content, JSON round trip, validation and the printed table."""
import json

import pytest

from planner.costmodel import CostOptions
from planner.jsonio import JsonFileError, write_json_atomic
from planner.plan import PLAN_SCHEMA_VERSION, format_plan_table, load_plan, make_plan
from planner.solve import solve
from tests.synthetic import synthetic_profile


def small_profile():
    return synthetic_profile(forward=[0.001, 0.004, 0.004, 0.002], backward=[0.002, 0.008, 0.008, 0.004],
                             params=[1 << 20, 4 << 20, 4 << 20, 2 << 20], saved=[1 << 16, 1 << 18, 1 << 18, 1 << 16],
                             cut_act=[4096, 4096, 1024], cut_grad=[4096, 2048, 0], sizes=(1, 2, 4),
                             names=["embed", "block0", "block1", "head"],
                             model={"entry": "models.toy:build", "args": {"width": 8}, "seed": 7})


def make(cap=64e6, schedule="1f1b"):
    profile = small_profile()
    opts = CostOptions(num_stages=3, global_batch=8, schedule=schedule, memory_cap=cap, latency=1e-5)
    solution = solve(profile, opts)
    return profile, solution, make_plan(profile, solution, opts, "profiles/toy.json")


def test_plan_content():
    profile, solution, plan = make()
    assert plan["schema_version"] == PLAN_SCHEMA_VERSION and plan["kind"] == "plan"
    assert plan["model"] == {"entry": "models.toy:build", "args": {"width": 8}, "seed": 7}
    assert plan["profile"]["path"] == "profiles/toy.json" and plan["profile"]["device_name"] == "synthetic"
    assert plan["micro_batch_size"] * plan["num_micro_batches"] == 8
    assert plan["predicted_iteration_s"] == solution.objective
    stages = plan["stages"]
    assert [u for st in stages for u in st["units"]] == ["embed", "block0", "block1", "head"]
    assert stages[0]["recv"] == [] and stages[-1]["send"] == []
    b = plan["micro_batch_size"]
    for left, right in zip(stages, stages[1:]):
        assert left["end_unit"] == right["first_unit"]
        assert left["send"] == right["recv"]
        assert left["send"] == [v.at(b) for v in profile.cut(left["end_unit"]).values]
        assert any(v["kind"] == "constant" for v in left["send"])
    for st in stages:
        mem = st["memory_bytes"]
        assert mem["total"] == mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
        assert mem["total"] <= plan["memory_per_device_bytes"]
    assert plan["solver"]["status"] == "optimal" and plan["solver"]["gap"] == 0.0


def test_json_round_trip(tmp_path):
    _, _, plan = make(cap=None)
    path = tmp_path / "plan.json"
    write_json_atomic(str(path), plan)
    loaded = load_plan(str(path))
    assert loaded == json.loads(json.dumps(plan))
    assert loaded["memory_per_device_bytes"] is None


def test_table_lists_every_stage():
    _, solution, plan = make()
    table = format_plan_table(plan)
    lines = table.splitlines()
    assert lines[0].split()[0] == "stage" and "/ cap" in lines[0]
    for st in plan["stages"]:
        row = next(line for line in lines[2:] if line.split() and line.split()[0] == str(st["index"]))
        assert st["units"][0] in row and f"{st['time_s'] * 1e3:.3f}" in row
    assert f"micro-batch size {plan['micro_batch_size']} x {plan['num_micro_batches']}" in table
    assert "proven optimal for this cost model (gap 0.00%)" in table
    plan["solver"].update(status="feasible", gap=0.0123, bound=0.5)
    assert "best found, gap 1.23% from the bound 500.000 ms" in format_plan_table(plan)
    no_cap = make(cap=None)[2]
    assert "/ cap" not in format_plan_table(no_cap)


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p.update(schema_version=99), "schema_version 99"),
    (lambda p: p.pop("stages"), "lacks stages"),
    (lambda p: p.update(kind="profile"), "not a plan file"),
    (lambda p: p["stages"][1].pop("send"), "stage 1 lacks send"),
])
def test_load_plan_rejects_bad_files(tmp_path, mutate, match):
    _, _, plan = make()
    mutate(plan)
    path = tmp_path / "bad.json"
    write_json_atomic(str(path), plan)
    with pytest.raises(JsonFileError, match=match):
        load_plan(str(path))


def test_load_plan_rejects_non_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(JsonFileError, match="not valid JSON"):
        load_plan(str(path))
    with pytest.raises(JsonFileError, match="does not exist"):
        load_plan(str(tmp_path / "missing.json"))


def test_decision_fields_and_png(tmp_path, capsys):
    from planner.cli import main
    _, solution, plan = make()
    assert plan["data_parallel"] == 1 and plan["virtual_stages"] == 1 and plan["pipeline_stages"] == 3
    assert plan["global_batch"] == plan["data_parallel"] * plan["num_micro_batches"] * plan["micro_batch_size"]
    assert [st["device"] for st in plan["stages"]] == [0, 1, 2]
    assert all(st["recompute"] == [] for st in plan["stages"])
    assert "bubble" in format_plan_table(plan).splitlines()[0]
    path = tmp_path / "plan.json"
    write_json_atomic(str(path), plan)
    png = tmp_path / "plan.png"
    assert main(["show", str(path), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
