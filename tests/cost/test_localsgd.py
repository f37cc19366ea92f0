"""Local SGD in the planner (issue 22): the model averaging charged / H per step, the rule choosing H,
ties reduced within one replica, the plan's fields, and one-line refusals of what it cannot plan."""
import dataclasses
import json

import pytest

from planner.cli.main import main as planner_main
from planner.cost.localsgd import averaging_seconds_per_byte, choose_sync_every
from planner.cost.model import compute_profile, evaluate
from planner.cost.options import CostOptions
from planner.plan.file import Plan, load_plan, save_plan
from planner.plan.make import make_plan
from planner.profile.profile import save_profile
from planner.solve.api import solve
from planner.solve.ilp import Program
from planner.solve.localsgd import averaging_s, compute_s, solve_local_sgd
from tests.support.synthetic import synthetic_profile

PARAMS = [4000, 8000, 8000, 4000]


def _profile(tie=False):
    profile = synthetic_profile(forward=[1e-3, 2e-3, 2e-3, 1e-3], backward=[2e-3, 4e-3, 4e-3, 2e-3], params=PARAMS,
                                saved=[100] * 4, cut_act=[64] * 3)
    if tie:  # the first and last units share a weight (an embedding and its LM head)
        profile.extra["shared_parameters"] = [{"name": "w", "units": ["u0", "u3"], "bytes": 4000}]
    return profile


def _opts(**changes):
    base = dict(pipeline_ranks=2, global_batch=8, data_parallel=2, dp_bandwidth=1e6, bandwidth=1e8)
    return CostOptions(**dict(base, **changes))


def test_the_averaging_is_charged_once_every_h_steps():
    profile = _profile()
    every_step = evaluate(profile, [2], 2, _opts()).durations
    for H in (2, 5):
        local = evaluate(profile, [2], 2, _opts(sync_every=H)).durations
        for rank, trained in enumerate((sum(PARAMS[:2]), sum(PARAMS[2:]))):
            averaging = averaging_seconds_per_byte("fp32", 2, "float32", 1e6) * trained
            assert averaging == pytest.approx(2 * (2 - 1) / 2 * trained / 1e6)  # all-reduce of the fp32 weights
            assert local[("reduce", rank)] == pytest.approx(averaging / H)
            # fp32 gradients weigh what the weights do: H = 1's gradient all-reduce is one averaging
            assert every_step[("reduce", rank)] == pytest.approx(averaging)
    # one replica: nothing to average, whatever H
    assert evaluate(profile, [2], 4, _opts(data_parallel=1, sync_every=4)).durations[("reduce", 0)] == 0.0


BUFFERS = [0, 512, 0, 2048]  # floating-point buffer bytes per unit (BatchNorm's running statistics)


def _with_buffers(profile, buffers=BUFFERS):
    return dataclasses.replace(profile, units=[dataclasses.replace(u, buffer_bytes=n)
                                               for u, n in zip(profile.units, buffers)])


def test_the_averaging_counts_the_buffers_it_averages_and_solvers_agree():
    """runtime.localsgd averages floating-point buffers with the trainable parameters: charged, in their
    own dtype (not the compute dtype's), / H; the branch and bound and the integer program find brute
    force's optimum with them; a profile without buffer_bytes (older files) charges none."""
    from planner.profile.profile import Profile
    from tests.support.solvers import both_solvers_match_brute_force

    profile = _with_buffers(_profile())
    plain = evaluate(_profile(), [2], 2, _opts(sync_every=4)).durations
    for precision in ("fp32", "bf16-mixed"):
        local = evaluate(profile, [2], 2, _opts(sync_every=4, precision=precision)).durations
        without = evaluate(_profile(), [2], 2, _opts(sync_every=4, precision=precision)).durations
        for rank, buffers in enumerate((512, 2048)):
            assert local[("reduce", rank)] - without[("reduce", rank)] == pytest.approx(
                2 * (2 - 1) / 2 * buffers / 1e6 / 4)
    back = Profile.from_json(json.loads(json.dumps(profile.to_json())))
    assert [u.buffer_bytes for u in back.units] == BUFFERS
    old = profile.to_json()
    for unit in old["units"]:
        del unit["buffer_bytes"]
    assert evaluate(Profile.from_json(old), [2], 2, _opts(sync_every=4)).durations == plain
    # buffers heavy enough to move the best split: solvers == brute force
    heavy = _with_buffers(synthetic_profile(forward=[1e-3] * 6, backward=[2e-3] * 6, params=[4000] * 6,
                                            saved=[100] * 6, cut_act=[64] * 5, sizes=(1, 2)),
                          [40000, 0, 0, 0, 0, 40000])
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        opts = _opts(sync_every=2, schedule=schedule, virtual_stages=v)
        both_solvers_match_brute_force(heavy, opts)


def test_a_tie_is_reduced_within_one_replica_and_the_integer_program_agrees():
    profile = _profile(tie=True)
    per_step = evaluate(profile, [2], 2, _opts()).durations[("tie", "w")]
    local = evaluate(profile, [2], 2, _opts(sync_every=3)).durations[("tie", "w")]
    assert per_step == pytest.approx(2 * 3 / 4 * 4000 / 1e8)  # 4 holders: 2 ranks x 2 replicas
    assert local == pytest.approx(2 * 1 / 2 * 4000 / 1e8)  # 2 holders: the ranks of one replica
    # the integer program charges the same: its value on the split's longest path is the simulated step
    opts = _opts(sync_every=3, bandwidth=1e5)  # a slow tie: on the step's longest path
    cost = evaluate(profile, [2], 2, opts)
    assert ("tie", "w") in cost.critical_path.count()
    program = Program(compute_profile(profile, opts), 2, opts, [0, 0, 1, 1], [0, 0, 1, 1])  # the split [2] alone
    program.add_form(cost.critical_path, 1e9)
    assert program.solve(None, None, "highs").value_s == pytest.approx(cost.iteration_s, rel=1e-9)


@pytest.mark.parametrize("averaging,compute,h_max,expected", [
    (1.0, 100.0, 8, 1),    # within 5 % every step: the per-step all-reduce
    (1.0, 10.0, 8, 2),     # 1/2 <= 0.5 < 1/1
    (1.0, 4.0, 8, 5),      # 1/5 <= 0.2 < 1/4
    (1.0, 1.0, 8, 8),      # 20 steps would be needed: the bound
    (0.0, 1.0, 8, 1),      # nothing to average
])
def test_the_smallest_h_within_the_tolerance(averaging, compute, h_max, expected):
    assert choose_sync_every(averaging, compute, h_max, 0.05) == expected


def test_solve_chooses_h_by_the_rule_and_the_plan_states_it(tmp_path):
    profile = _profile()
    opts = _opts(global_batch=16)
    averaged = []
    for h_max, tolerance in ((64, 0.05), (64, 0.5), (3, 0.05)):
        def run(options, scenario):
            return solve(profile, options, method="ilp", devices=None if scenario else 4)

        solution = solve_local_sgd(profile, opts, h_max, tolerance, run)
        chosen = solution.options
        if chosen.data_parallel == 1:
            assert chosen.sync_every == 1
            continue
        H = chosen.sync_every
        averaged.append(H)
        A, C = averaging_s(solution) if H > 1 else 0.0, compute_s(profile, solution, chosen)
        if H > 1:  # the rule: the smallest H whose averaging per step is within the tolerance, else the bound
            assert A / H <= tolerance * C or H == h_max
            assert A / (H - 1) > tolerance * C
        plan = make_plan(profile, solution, opts, "p.json")
        assert plan.sync_every == H
        if H > 1:
            assert plan.averaging_s == pytest.approx(A)
            assert max(plan.step_durations["reduce"]) == pytest.approx(A / H)
        path = str(tmp_path / "plan.json")
        save_plan(plan, path)
        assert load_plan(path).to_json() == plan.to_json()
    assert any(H > 1 for H in averaged), averaged  # the rule was checked, not skipped
    # a slow data-parallel link: averaging rarely is what fits the tolerance
    slow = solve_local_sgd(profile, _opts(global_batch=16, dp_bandwidth=1e4), 64, 0.05,
                           lambda options, scenario: solve(profile, options, method="ilp"))
    assert slow.options.sync_every > 1


def test_a_plan_without_sync_every_loads_as_one_and_is_written_as_before(tmp_path):
    solution = solve(_profile(), _opts(), method="ilp")
    raw = make_plan(_profile(), solution, _opts(), "p.json").to_json()
    assert "sync_every" not in raw and "averaging_s" not in raw  # its digest is an older plan's
    plan = Plan.from_json(raw)
    assert plan.sync_every == 1 and plan.to_json() == raw


def _cli(capsys, argv):
    code = planner_main(argv)
    return code, capsys.readouterr().err


def test_what_local_sgd_cannot_plan_is_refused_in_one_line(tmp_path, capsys):
    path = str(tmp_path / "profile.json")
    save_profile(_profile(), path)
    out = str(tmp_path / "plan.json")
    base = ["solve", path, "--global-batch", "16", "-o", out]
    for extra, words in [(["--devices", "4", "--local-sgd-max", "0"], "--local-sgd-max is 1 to 100000 steps"),
                         (["--devices", "4", "--local-sgd-max", "1000000000"], "--local-sgd-max is 1 to 100000 steps"),
                         (["--devices", "1", "--local-sgd-max", "2"], "--devices 1 leaves one: give 2 or more"),
                         (["--devices", "4", "--local-sgd-max", "4", "--sync-overhead", "inf"], "at most 10"),
                         (["--devices", "4", "--local-sgd-max", "4", "--shard", "optimizer"], "needs --shard none"),
                         (["--stages", "2", "--local-sgd-max", "4"], "give --devices N"),
                         (["--devices", "4", "--local-sgd-max", "4", "--sync-overhead", "0"], "positive fraction")]:
        code, err = _cli(capsys, base + extra)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (extra, err)
    assert not (tmp_path / "plan.json").exists()
    # slow pipeline messages: the solver takes replicas
    code, err = _cli(capsys, base + ["--devices", "4", "--local-sgd-max", "8", "--dp-bandwidth", "1MB",
                                     "--bandwidth", "1kB"])
    assert code == 0, err
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["data_parallel"] > 1 and plan["sync_every"] > 1
    # a plan file asking what cannot run: H > 1 with one replica, with sharding, or placed on a topology
    p, d = plan["pipeline_stages"], plan["data_parallel"]
    swapped = [[(d - 1 - r) * p + i for i in range(p)] for r in range(d)]  # replica r on replica d-1-r's devices
    for change, words in [(dict(data_parallel=1, global_batch=plan["global_batch"] // plan["data_parallel"]),
                           "one data-parallel replica"), (dict(shard="optimizer"), "unsharded"),
                          (dict(sync_every=0), "at least 1 step"), (dict(placement=swapped), "--topology")]:
        bad = str(tmp_path / "bad.json")
        with open(bad, "w") as f:
            json.dump(dict(plan, **change), f)
        code, err = _cli(capsys, ["show", bad])
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (change, err)
    code, err = _cli(capsys, ["show", out])
    assert code == 0
    target = str(tmp_path / "out.toml")  # the exported configuration would train otherwise
    code, err = _cli(capsys, ["export", out, "--format", "torchtitan", "-o", target])
    assert code == 2 and "local SGD" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.toml").exists()


def test_local_sgd_options_are_checked():
    with pytest.raises(ValueError, match="integer >= 1"):
        _opts(sync_every=0).validate()
    with pytest.raises(ValueError, match="--shard none"):
        _opts(sync_every=2, shard="gradients").validate()
    # a topology placement's exchange is planned per step: local SGD is refused on one
    from planner.cost.placement import Placement
    from planner.cost.topology_file import topology_from_json

    sites = topology_from_json({"levels": [{"name": "site", "count": 2, "bandwidth": 1e6, "latency": 0.0},
                                           {"name": "device", "count": 2, "bandwidth": 1e8, "latency": 0.0}]})
    placed = _opts(placement=Placement(sites, ((0, 1), (2, 3))))
    placed.validate()
    with pytest.raises(ValueError, match="not planned on a --topology"):
        dataclasses.replace(placed, sync_every=2).validate()
    assert dataclasses.replace(_opts(), sync_every=2).tie_replicas == 1
