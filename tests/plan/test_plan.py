"""The plan file: content, JSON round trip, validation and the printed table."""
import json

import pytest

from planner.cost.options import CostOptions
from planner.jsonio import JsonFileError, write_json_atomic
from planner.plan.file import PLAN_SCHEMA_VERSION, Plan, load_plan, save_plan
from planner.plan.make import make_plan
from planner.plan.table import format_plan_table
from planner.solve.api import solve
from tests.support.synthetic import synthetic_profile


def small_profile():
    return synthetic_profile(forward=[0.001, 0.004, 0.004, 0.002], backward=[0.002, 0.008, 0.008, 0.004],
                             params=[1 << 20, 4 << 20, 4 << 20, 2 << 20], saved=[1 << 16, 1 << 18, 1 << 18, 1 << 16],
                             cut_act=[4096, 4096, 1024], cut_grad=[4096, 2048, 0], sizes=(1, 2, 4),
                             names=["embed", "block0", "block1", "head"],
                             model={"entry": "models.toy:build", "args": {"width": 8}, "seed": 7})


def make(cap=64e6, schedule="1f1b"):
    profile = small_profile()
    opts = CostOptions(pipeline_ranks=3, global_batch=8, schedule=schedule, memory_cap=cap, latency=1e-5)
    solution = solve(profile, opts)
    return profile, solution, make_plan(profile, solution, opts, "profiles/toy.json")


def test_plan_content():
    profile, solution, typed = make()
    plan = typed.to_json()  # the file's content
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
    save_plan(plan, str(path))
    loaded = load_plan(str(path))
    assert loaded == plan and loaded.to_json() == json.loads(path.read_text())
    assert loaded.memory_per_device_bytes is None and loaded.digest() == plan.digest()
    # keys this version does not know are kept, and change the digest
    with_note = dict(plan.to_json(), note="kept")
    assert Plan.from_json(with_note).to_json() == with_note and Plan.from_json(with_note).digest() != plan.digest()


def test_table_lists_every_stage():
    _, solution, plan = make()
    table = format_plan_table(plan)
    lines = table.splitlines()
    assert lines[0].split()[0] == "stage" and "/ cap" in lines[0]
    for st in plan.stages:
        row = next(line for line in lines[2:] if line.split() and line.split()[0] == str(st.index))
        assert st.units[0] in row and f"{st.time_s * 1e3:.3f}" in row
    assert f"micro-batch size {plan.micro_batch_size} x {plan.num_micro_batches}" in table
    assert "proven optimal for this cost model (gap 0.00%)" in table
    plan.solver.update(status="feasible", gap=0.0123, bound=0.5)
    assert "best found, gap 1.23% from the bound 500.000 ms" in format_plan_table(plan)
    plan.solver.update(seconds=None)  # a hand-edited plan's null (a traceback in planner show before)
    assert "branch-and-bound, 0.00 s]" in format_plan_table(plan) or ", 0.00 s]" in format_plan_table(plan)
    no_cap = make(cap=None)[2]
    assert "/ cap" not in format_plan_table(no_cap)


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p.update(schema_version=99), "schema_version 99"),
    (lambda p: p.pop("stages"), "lacks stages"),
    (lambda p: p.update(kind="profile"), "not a plan file"),
    (lambda p: p["stages"][1].pop("send"), "stage 1 lacks send"),
    (lambda p: p.update(global_batch="8"), "global_batch '8', expected an integer"),
    (lambda p: p["stages"][0].update(units="embed"), "stage 0 has units 'embed', expected a list of names"),
    (lambda p: p["stages"][2].update(forward_s=None), "stage 2 has forward_s None, expected a number"),
    (lambda p: p.update(schedule="zigzag"), "schedule 'zigzag', not one of 1f1b, gpipe, interleaved, bfs"),
    (lambda p: p.update(global_batch=9), "global batch 9 is not 1 replica"),
    (lambda p: p["stages"].__setitem__(1, "stage"), "stage 1 is not an object"),
    (lambda p: p["stages"][0].update(units=[], end_unit=0), "stage 0 runs units .0, 0. and names 0"),
    (lambda p: p["stages"][1].update(first_unit=p["stages"][1]["first_unit"] + 1), "stage 1 runs units"),
    (lambda p: p["stages"][1]["units"].__setitem__(0, p["stages"][0]["units"][0]), "names unit 'embed' twice"),
    (lambda p: p["stages"][1].update(recompute=["embed"]), "stage 1 recomputes 'embed', not one of its units"),
    (lambda p: p["stages"][1].update(in_flight=-1), "stage 1 has in_flight -1"),  # show read it (a fuzz's minor)
    (lambda p: p["model"].update(entry=7), "has model"),
    (lambda p: p["model"].update(seed="x"), "has model"),
    (lambda p: p["profile"].update(threads=-3), "profile.threads -3"),
    (lambda p: p["profile"].update(flush_subnormals=1), "profile.flush_subnormals 1: true or false"),
    (lambda p: p.update(optimizer="zzz"), "optimizer 'zzz', not one of sgd, adam, adamw"),
    (lambda p: p.update(bandwidth_bytes_per_s=-1.0), "bandwidth_bytes_per_s -1.0: a finite number > 0"),
    (lambda p: p.update(latency_s=-1e-6), "latency_s -1e-06: a finite number >= 0"),
    (lambda p: p["stages"][1].update(forward_s=-1.0), "stage 1 forward_s -1.0: a finite number >= 0"),
    (lambda p: p.update(num_micro_batches=10 ** 9, global_batch=10 ** 9 * p["micro_batch_size"]),
     "1000000000 micro-batches a step, more than 4096"),  # its lists would take minutes and gigabytes
    # a fuzz of every command: show and simulate stopped with a traceback, execute after training
    (lambda p: p["stages"][0]["memory_bytes"].update(device_total=None), "stage 0 memory_bytes 'device_total' None"),
    (lambda p: p["stages"][1]["memory_bytes"].update(total="x"), "stage 1 memory_bytes 'total' 'x'"),
    (lambda p: p["stages"][1].update(memory_bytes={}), "stage 1 has no memory_bytes 'params'"),
    (lambda p: p["stages"][1]["recv"][0].update(dtype="float33"), "stage 1 recv value .* has no dtype"),
    (lambda p: p["stages"][1]["recv"][0].update(shape="x"), "stage 1 recv value .* has no dtype"),
    (lambda p: p["stages"][1]["recv"][0].update(shape=[-4, 8]), "stage 1 recv value .* shape"),  # a rank's traceback
    (lambda p: p["stages"][1]["recv"][0].update(shape=[1 << 30, 1 << 20]), "stage 1 recv value .* shape"),
    # the twenty-sixth session's fuzz: a traceback in simulate, failures in the ranks or after training
    (lambda p: p["step_durations"].setdefault("collectives", []).append({"term": ["x"], "ranks": [0, 9], "seconds": 0.0}),
     "collectives name ranks outside 0..2"),
    (lambda p: p["profile"].update(threads=10 ** 30), "profile.threads 10+: an integer 0..4096"),
    (lambda p: p["profile"].update(host_kernel_s=[1]), r"profile.host_kernel_s \[1\]: seconds"),
    (lambda p: p["profile"].update(host_kernel_s="abc"), "profile.host_kernel_s .abc.: seconds"),
    (lambda p: p["profile"].update(torch_version=213), "profile.torch_version 213: a version string"),
    # the twenty-ninth session's fuzz: tracebacks in show (the certificate's numbers) and in every reader (a rank
    # of Infinity)
    (lambda p: p["solver"].update(seconds=[1]), r"solver.seconds \[1\]: a number or null"),
    (lambda p: p["solver"].update(gap={"a": 1}), "solver.gap {'a': 1}: a number or null"),
    (lambda p: p["solver"].update(bound="x"), "solver.bound 'x': a number or null"),
    (lambda p: p["stages"][1]["recv"][0].update(shape=list(reversed(p["stages"][1]["recv"][0]["shape"])) + [1]),
     "stage 0 sends other values than stage 1 receives"),
    (lambda p: p["stages"][0]["send"][0].update(requires_grad=not p["stages"][0]["send"][0].get("requires_grad", False)),
     "stage 0 sends other values than stage 1 receives"),
])
def test_load_plan_rejects_bad_files(tmp_path, mutate, match):
    plan = make()[2].to_json()
    mutate(plan)
    path = tmp_path / "bad.json"
    write_json_atomic(str(path), plan)
    with pytest.raises(JsonFileError, match=match):
        load_plan(str(path))


def test_a_collective_rank_of_infinity_is_one_line(tmp_path):
    # the twenty-ninth session's fuzz: an OverflowError's traceback in show, simulate and export (int(inf))
    plan = make()[2].to_json()
    plan["step_durations"].setdefault("collectives", []).append({"term": ["x"], "ranks": [0, float("inf")],
                                                                 "seconds": 0.0})
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plan))  # Infinity, as json.dump writes it (write_json_atomic writes null)
    with pytest.raises(JsonFileError, match="malformed step_durations"):
        load_plan(str(path))


def test_a_file_from_a_newer_release_says_upgrade(tmp_path):
    # re-creating a profile, plan or report means measuring, solving or training again: a newer
    # release's file was told only that
    from planner.fidelity.check import REPORT_SCHEMA_VERSION, load_report
    from planner.profile.profile import PROFILE_SCHEMA_VERSION, Profile

    newer = "a newer pipeplanner wrote it .schema_version {}; this one reads {}.: upgrade"
    plan = make()[2].to_json()
    path = str(tmp_path / "plan.json")
    write_json_atomic(path, dict(plan, schema_version=PLAN_SCHEMA_VERSION + 1))
    with pytest.raises(JsonFileError, match=newer.format(PLAN_SCHEMA_VERSION + 1, PLAN_SCHEMA_VERSION)):
        load_plan(path)
    write_json_atomic(path, dict(plan, schema_version=0))  # older: re-create it, as before
    with pytest.raises(JsonFileError, match="schema_version 0") as older:
        load_plan(path)
    assert "pipeplanner wrote" not in str(older.value)
    profile = synthetic_profile([0.01] * 3, [0.02] * 3, [0] * 3, [0] * 3, [64] * 2, sizes=(1,)).to_json()
    with pytest.raises(JsonFileError, match=newer.format(PROFILE_SCHEMA_VERSION + 1, PROFILE_SCHEMA_VERSION)):
        Profile.from_json(dict(profile, schema_version=PROFILE_SCHEMA_VERSION + 1))
    write_json_atomic(path, {"kind": "report", "stages": [], "schema_version": REPORT_SCHEMA_VERSION + 1})
    with pytest.raises(JsonFileError, match=newer.format(REPORT_SCHEMA_VERSION + 1, REPORT_SCHEMA_VERSION)):
        load_report(path)


def test_the_runtime_reads_plans_with_the_same_loader(tmp_path, capsys):
    """`runtime show` refuses what `planner show` refuses, with the same message."""
    from planner.cli.main import main as planner_main
    from runtime.cli import main as runtime_main

    plan = make()[2].to_json()
    del plan["solver"]
    path = tmp_path / "plan.json"
    write_json_atomic(str(path), plan)
    messages = []
    for main in (planner_main, runtime_main):
        assert main(["show", str(path)]) == 2
        messages.append(capsys.readouterr().err)
    assert messages[0] == messages[1] and "lacks solver" in messages[0]


def test_load_plan_rejects_non_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(JsonFileError, match="not valid JSON"):
        load_plan(str(path))
    with pytest.raises(JsonFileError, match="does not exist"):
        load_plan(str(tmp_path / "missing.json"))


def test_decision_fields_and_png(tmp_path, capsys):
    from planner.cli.main import main
    _, solution, typed = make()
    plan = typed.to_json()
    assert plan["data_parallel"] == 1 and plan["virtual_stages"] == 1 and plan["pipeline_stages"] == 3
    assert plan["global_batch"] == plan["data_parallel"] * plan["num_micro_batches"] * plan["micro_batch_size"]
    assert [st["device"] for st in plan["stages"]] == [0, 1, 2]
    assert all(st["recompute"] == [] for st in plan["stages"])
    assert "bubble" in format_plan_table(typed).splitlines()[0]
    path = tmp_path / "plan.json"
    save_plan(typed, str(path))
    png = tmp_path / "plan.png"
    assert main(["show", str(path), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def replicated_plan(schedule="1f1b"):
    from planner.solve.replicas import solve_replicated
    profile = synthetic_profile(forward=[0.001, 0.001, 0.010, 0.001], backward=[0.002, 0.002, 0.020, 0.002],
                                params=[40_000_000, 40_000_000, 1000, 40_000_000], saved=[100] * 4,
                                cut_act=[1000] * 3, sizes=(1, 2), names=["embed", "block0", "block1", "head"])
    opts = CostOptions(pipeline_ranks=4, global_batch=8, schedule=schedule, bandwidth=1e9, memory_cap=1e9)
    solution = solve_replicated(profile, opts)
    return solution, make_plan(profile, solution, opts, "profiles/toy.json")


def test_replicated_plan_keys():
    solution, typed = replicated_plan()
    plan = typed.to_json()
    assert [st["replicas"] for st in plan["stages"]] == [1, 2, 1]
    assert [st["device"] for st in plan["stages"]] == [0, 1, 3]  # offset_g = sum_{h<g} r_h
    assert plan["pipeline_stages"] == 4 and plan["virtual_stages"] == 1 and plan["data_parallel"] == 1
    assert plan["num_micro_batches"] >= 2
    cost = solution.cost
    for st, sc in zip(plan["stages"], cost.stages):  # per replica device
        assert st["in_flight"] == sc.in_flight and st["memory_bytes"]["device_total"] == cost.device_memory[sc.device]
    assert plan["predicted_iteration_s"] == solution.objective
    assert plan["solver"]["status"] == solution.status and plan["solver"]["gap"] == solution.gap
    table = format_plan_table(typed)
    assert "replicas" in table.splitlines()[0] and "replicated stages on 4 devices" in table
    row = next(line for line in table.splitlines()[2:] if line.split()[:1] == ["1"])
    assert row.split()[1:3] == ["1-2", "2"]


def test_unreplicated_plans_have_no_replicas_key():
    typed = make()[2]
    plan = typed.to_json()
    assert all("replicas" not in st for st in plan["stages"])
    assert "replicas" not in format_plan_table(typed).splitlines()[0]
    for st in plan["stages"]:  # "replicas": 1 (what absent means) is accepted as it stands
        st["replicas"] = 1
    assert Plan.from_json(plan).to_json() == plan


@pytest.mark.parametrize("mutate,match", [
    (lambda p: p["stages"][1].update(replicas=0), "replicas 0"),
    (lambda p: p["stages"][2].update(device=2), "expected 3"),
    (lambda p: p.update(pipeline_stages=3), "add up to 4"),
    (lambda p: p.update(schedule="interleaved"), "gpipe or 1f1b"),
    (lambda p: p.update(num_micro_batches=1), "needs at least as many"),
])
def test_load_plan_rejects_bad_replicas(tmp_path, mutate, match):
    plan = replicated_plan()[1].to_json()
    path = tmp_path / "plan.json"
    write_json_atomic(str(path), plan)
    assert load_plan(str(path)).pipeline_stages == 4
    mutate(plan)
    write_json_atomic(str(path), plan)
    with pytest.raises(JsonFileError, match=match):
        load_plan(str(path))


def test_plan_for_split_with_replicas():
    from planner.plan.make import plan_for_split
    profile = small_profile()
    plan = Plan.from_json(plan_for_split(profile, [1, 3], 1, 8, schedule="gpipe", replicas=[1, 3, 1]).to_json()).to_json()
    assert [st["device"] for st in plan["stages"]] == [0, 1, 4] and plan["pipeline_stages"] == 5
    assert [st["in_flight"] for st in plan["stages"]] == [8, 3, 8]


def test_show_draws_a_replicated_plan(tmp_path):
    from planner.cli.main import main
    _, plan = replicated_plan()
    path, png = tmp_path / "plan.json", tmp_path / "plan.png"
    save_plan(plan, str(path))
    assert main(["show", str(path), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
