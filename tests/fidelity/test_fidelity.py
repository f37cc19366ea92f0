"""The simulation as the prediction, predicted vs measured, and calibration."""
import dataclasses
import json
import random
import re

import pytest

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.fidelity.calibrate import calibrate_profile
from planner.fidelity.check import check_report
from planner.fidelity.simulation import replay_s, simulate_plan
from planner.plan.make import make_plan
from planner.profile.hostspeed import at_host_speed, host_slowdown, host_speed_lines, reference_kernel_s, slowdown_warning
from planner.solve.api import solve
from tests.support.runs import execute, plan_with, profile_of, report_of, run_cli, run_here
from tests.support.synthetic import synthetic_profile


def _plan(times, m, schedule, b=1):
    """A plan of len(times) one-unit stages with forward t and backward 2t, no transfers."""
    n = len(times)
    profile = synthetic_profile(forward=[{1: t} for t in times], backward=[{1: 2 * t} for t in times],
                                params=[0] * n, saved=[{1: 0}] * n, cut_act=[{1: 0}] * (n - 1), sizes=(1,))
    return plan_with(profile, list(range(1, n)), b, m * b, schedule)


@pytest.mark.parametrize("seed", range(20))
def test_prediction_is_the_simulation_and_meets_the_closed_forms_where_they_are_exact(seed):
    rng = random.Random(seed)
    p, m = rng.randint(1, 6), rng.randint(1, 10)
    times = [rng.uniform(0.5, 2.0) for _ in range(p)]
    closed = lambda ts: sum(3 * t for t in ts) + (m - 1) * max(3 * t for t in ts)
    gpipe = _plan(times, m, "gpipe")
    assert simulate_plan(gpipe).iteration_s == pytest.approx(gpipe.predicted_iteration_s, rel=1e-12)
    # GPipe with free messages: the flow shop of identical jobs, sum_s T_s + (m - 1) max_s T_s
    assert gpipe.predicted_iteration_s == pytest.approx(closed(times), rel=1e-9)
    # 1F1B: never slower than GPipe here, and the same for equal stages
    one = _plan(times, m, "1f1b")
    assert simulate_plan(one).iteration_s == pytest.approx(one.predicted_iteration_s, rel=1e-12)
    assert one.predicted_iteration_s <= closed(times) * (1 + 1e-9)
    equal = _plan([times[0]] * p, m, "1f1b")
    assert equal.predicted_iteration_s == pytest.approx(closed([times[0]] * p), rel=1e-9)


def test_each_rank_steps_its_own_units_at_the_end_of_its_list():
    def two_units(steps):
        profile = synthetic_profile(forward=[{1: 1.0}, {1: 2.0}], backward=[{1: 2.0}, {1: 4.0}], params=[10, 10],
                                    saved=[{1: 0}] * 2, cut_act=[{1: 0}], sizes=(1,))
        for unit, step in zip(profile.units, steps):
            unit.optimizer_s = {"sgd": step}
        return profile

    base = CostOptions(pipeline_ranks=2, global_batch=4, schedule="gpipe")
    plain = evaluate(two_units([0.0, 0.0]), [1], 1, base).iteration_s
    profile = two_units([0.2, 0.3])
    # rank 0 ends the step (its last backward comes after rank 1's): its own 0.2 s step is on the
    # path; rank 1's 0.3 s step runs while rank 0 still computes
    charged = evaluate(profile, [1], 1, base.with_(step_overhead_s=0.1))
    assert charged.iteration_s == pytest.approx(plain + 0.2 + 0.1)
    assert charged.durations[("step", 0)] == pytest.approx(0.2) and charged.durations[("step", 1)] == 0.3
    solution = solve(profile, base, method="ilp")
    assert solution.objective == pytest.approx(plain + 0.2)
    plan = make_plan(profile, solution, base, "p.json")
    assert simulate_plan(plan).iteration_s == pytest.approx(plan.predicted_iteration_s, rel=1e-9)


def test_simulation_reports_busy_idle_and_memory():
    plan = _plan([1.0, 3.0], 4, "1f1b")
    sim = simulate_plan(plan)
    assert [r.stages for r in sim.ranks] == [[0], [1]]
    # the slow stage is busy 4 x (3 + 6); the fast one idles the rest
    assert sim.ranks[1].busy_s == pytest.approx(36.0)
    assert sim.ranks[0].idle_s == pytest.approx(sim.iteration_s - 12.0)
    assert 0 < sim.bubble_fraction < 1


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_simulation_counts_a_split_backward_as_busy(schedule):
    # the input and weight parts of a zero-bubble backward are compute: the simulation's busy time and
    # bubble are the plan's (it counted forwards and whole backwards only: 75 % bubble for 16 %)
    plan = _plan([1.0, 3.0, 2.0, 2.0], 8, schedule)
    sim = simulate_plan(plan)
    assert sim.bubble_fraction == pytest.approx(plan.bubble_fraction, rel=1e-9)
    assert sum(r.busy_s for r in sim.ranks) == pytest.approx(8 * 3 * (1.0 + 3.0 + 2.0 + 2.0), rel=1e-9)


def _fake_report(plan, forward_scale, backward_scale, measured_iteration_s, link=None):
    m = plan.num_micro_batches
    return {"model": plan.model, "measured_iteration_s": measured_iteration_s, "link": link,
            "stages": [{"rank": g, "replica": 0, "chunks": [g], "units": s.units,
                        "measured": {"forward_s": m * s.forward_s * forward_scale[g],
                                     "backward_s": m * s.backward_s * backward_scale[g],
                                     "recv_wait_s": 0.0, "send_wait_s": 0.0},
                        "predicted": {"forward_s": m * s.forward_s, "backward_s": m * s.backward_s}}
                       for g, s in enumerate(plan.stages)]}


def _staged_plan(times, schedule, m=8, forward_scale=1.0, backward_scale=1.0):
    """A plan of len(times) one-unit stages (forward t, backward 2t, scaled), 2 per rank under the
    schedules that run several, no transfers."""
    from planner.pipeline.schedule import schedule_virtual_stages
    from planner.solve.solution import Solution

    n, v = len(times), schedule_virtual_stages(schedule) or 2
    v = 1 if schedule in ("1f1b", "gpipe", "zb-h1") else v
    profile = synthetic_profile(forward=[{1: forward_scale * t} for t in times],
                                backward=[{1: 2 * backward_scale * t} for t in times], params=[0] * n,
                                saved=[{1: 0}] * n, cut_act=[{1: 0}] * (n - 1), sizes=(1,))
    opts = CostOptions(pipeline_ranks=n // v, global_batch=m, schedule=schedule, virtual_stages=v)
    cost = evaluate(profile, list(range(1, n)), 1, opts)
    solution = Solution(boundaries=list(range(1, n)), micro_batch_size=1, num_micro_batches=m, cost=cost,
                        status="fixed", objective=cost.iteration_s, bound=cost.iteration_s, gap=0.0, seconds=0.0,
                        method="fixed", backend="none")
    return make_plan(profile, solution, opts, "test")


def _rank_report(plan, forward_scale, backward_scale, optimizer_s=None):
    """What a run of `plan` reports per pipeline rank when its forwards took forward_scale[r] and its
    backwards backward_scale[r] times the plan's."""
    m, stages = plan.num_micro_batches, []
    for r, actions in enumerate(plan.instruction_lists()):
        chunks = sorted({a.stage for a in actions if a.kind.value == "forward"})
        forward = sum(m * plan.stages[g].forward_s for g in chunks)
        backward = sum(m * plan.stages[g].backward_s for g in chunks)
        measured = {"forward_s": forward * forward_scale[r], "backward_s": backward * backward_scale[r]}
        if optimizer_s is not None:
            measured["optimizer_s"] = optimizer_s[r]
        stages.append({"rank": r, "stage": r, "replica": 0, "chunks": chunks,
                       "units": [u for g in chunks for u in plan.stages[g].units], "measured": measured,
                       "predicted": {"forward_s": forward, "backward_s": backward}})
    return {"model": plan.model, "measured_iteration_s": 1.0, "stages": stages}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", "bfs", "zb-h1", "zb-v"])
def test_replay_simulates_the_lists_at_the_compute_the_run_measured(schedule):
    times = [1.0, 3.0, 2.0, 2.0]
    plan = _staged_plan(times, schedule)
    ranks = len(plan.instruction_lists())
    # a run at the plan's own speed replays to the plan's prediction
    assert replay_s(plan, _rank_report(plan, [1.0] * ranks, [1.0] * ranks)) == pytest.approx(
        plan.predicted_iteration_s, rel=1e-12)
    # every forward 1.5x, every backward (both parts of a split one) 2x: the plan of a profile so timed
    slow = _staged_plan(times, schedule, forward_scale=1.5, backward_scale=2.0)
    assert replay_s(plan, _rank_report(plan, [1.5] * ranks, [2.0] * ranks)) == pytest.approx(
        slow.predicted_iteration_s, rel=1e-9)
    assert slow.predicted_iteration_s > plan.predicted_iteration_s * 1.5


def test_replay_takes_each_ranks_own_speed_and_its_measured_optimizer_step():
    plan = _plan([1.0, 1.0], 4, "gpipe")
    base = plan.predicted_iteration_s
    # rank 1 computing 2x: the step is the plan of stages 1 and 2 s
    assert replay_s(plan, _rank_report(plan, [1.0, 2.0], [1.0, 2.0])) == pytest.approx(
        _plan([1.0, 2.0], 4, "gpipe").predicted_iteration_s)
    # rank 0 ends the step (its last backward comes after rank 1's): its measured step is on the path
    assert replay_s(plan, _rank_report(plan, [1.0, 1.0], [1.0, 1.0], optimizer_s=[0.5, 0.0])) == pytest.approx(base + 0.5)
    result = check_report(plan, dict(_rank_report(plan, [1.0, 1.0], [1.0, 1.0]), measured_iteration_s=base * 1.1))
    assert result["replayed"][1] == pytest.approx(base) and result["replayed"][2] == pytest.approx(0.1)


def test_calibration_scales_units_and_records_overhead():
    times = [1.0, 1.0, 2.0]
    n = len(times)
    profile = synthetic_profile(forward=[{1: t} for t in times], backward=[{1: 2 * t} for t in times],
                                params=[0] * n, saved=[{1: 0}] * n, cut_act=[{1: 0}] * (n - 1), sizes=(1,))
    plan = plan_with(profile, [2], 1, 4, "gpipe")  # stages: units 0-1, unit 2
    truth = plan_with(synthetic_profile(forward=[{1: 1.5}, {1: 1.5}, {1: 2.0}],
                                        backward=[{1: 3.0}, {1: 3.0}, {1: 2.0}], params=[0] * n,
                                        saved=[{1: 0}] * n, cut_act=[{1: 0}] * (n - 1), sizes=(1,)),
                      [2], 1, 4, "gpipe")
    overhead = 0.25
    measured = simulate_plan(truth).iteration_s + overhead
    report = _fake_report(plan, [1.5, 1.0], [1.5, 0.5], measured,
                          link={"bandwidth_bytes_per_s": 2e9, "latency_s": 1e-4})
    calibrated = calibrate_profile(profile, [(plan, report)])
    assert [u.forward_s[1] for u in calibrated.units] == pytest.approx([1.5, 1.5, 2.0])
    assert [u.backward_s[1] for u in calibrated.units] == pytest.approx([3.0, 3.0, 2.0])
    c = calibrated.extra["calibration"]
    assert c["step_overhead_s"] == pytest.approx(overhead, rel=1e-6)
    assert c["bandwidth_bytes_per_s"] == 2e9 and c["latency_s"] == 1e-4
    assert c["measured_links"] == [{"bandwidth_bytes_per_s": 2e9, "latency_s": 1e-4}]  # each run's, as measured
    # a flat ping-pong's bounding fit (a loaded host's, runtime.worker) is left out
    flat = dict(report, link={"bandwidth_bytes_per_s": 1e6, "latency_s": 1e-2, "flat": True})
    again = calibrate_profile(profile, [(plan, report), (plan, flat)]).extra["calibration"]
    assert again["measured_links"] == c["measured_links"]
    assert profile.units[0].forward_s[1] == 1.0  # the input profile is untouched
    result = check_report(plan, report)
    assert result["ranks"][0]["forward"][2] == pytest.approx(0.5)


def _two_unit_profile(scale=1.0):
    return synthetic_profile(forward=[{1: 1.0 * scale, 2: 1.8 * scale}, {1: 2.0 * scale, 2: 3.6 * scale}],
                             backward=[{1: 2.0 * scale, 2: 3.6 * scale}, {1: 4.0 * scale, 2: 7.2 * scale}],
                             params=[0, 0], saved=[{1: 0, 2: 0}] * 2, cut_act=[{1: 8, 2: 16}], sizes=(1, 2))


def test_calibration_from_several_runs_takes_per_size_medians():
    profile = _two_unit_profile()
    at1, at2 = plan_with(profile, [1], 1, 4, "gpipe"), plan_with(profile, [1], 2, 8, "gpipe")
    runs = [(at1, _fake_report(at1, [1.1, 1.2], [1.0, 1.0], 1.0)),
            (at1, _fake_report(at1, [1.3, 1.2], [1.0, 1.0], 1.0)),
            (at1, _fake_report(at1, [1.2, 9.0], [1.0, 1.0], 1.0)),  # one noisy run: the median ignores it
            (at2, _fake_report(at2, [0.9, 0.8], [1.1, 1.1], 1.0))]
    c = calibrate_profile(profile, runs)
    u0, u1 = c.units
    assert u0.forward_s[1] == pytest.approx(1.2) and u1.forward_s[1] == pytest.approx(2.0 * 1.2)
    assert u0.forward_s[2] == pytest.approx(1.8 * 0.9) and u1.backward_s[2] == pytest.approx(7.2 * 1.1)
    assert c.extra["calibration"]["unit_scale"]["u1"]["forward"] == {"1": pytest.approx(1.2), "2": pytest.approx(0.8)}
    assert c.extra["calibration"]["runs"] == 4
    # a size no run measured takes the median over all runs
    only1 = calibrate_profile(profile, runs[:1])
    assert only1.units[0].forward_s[2] == pytest.approx(1.8 * 1.1)


def test_calibration_scales_the_stage_overhead_with_the_ranks():
    profile = _two_unit_profile()
    profile.stage_overhead_s = {1: (0.5, 1.0), 2: (0.9, 1.8)}
    plan = plan_with(profile, [1], 1, 4, "gpipe")
    assert plan.stages[0].forward_s == pytest.approx(1.0 + 0.5)  # the stage pays it on top of its unit
    calibrated = calibrate_profile(profile, [(plan, _fake_report(plan, [1.5, 1.5], [2.0, 2.0], 1.0))])
    assert calibrated.stage_overhead_s[1] == pytest.approx((0.75, 2.0))
    assert calibrated.stage_overhead_s[2] == pytest.approx((1.35, 3.6))  # no run at b = 2: all runs' median
    again = plan_with(calibrated, [1], 1, 4, "gpipe")
    assert [s.forward_s for s in again.stages] == pytest.approx([1.5 * s.forward_s for s in plan.stages])
    # the engine's own cost is scaled with it (folded into the calibrated stage_overhead_s)
    engine = _two_unit_profile()
    engine.stage_overhead_s, engine.engine_overhead_s = {1: (0.3, 0.6), 2: (0.7, 1.4)}, (0.2, 0.4)
    calibrated = calibrate_profile(engine, [(plan, _fake_report(plan, [1.5, 1.5], [2.0, 2.0], 1.0))])
    assert calibrated.engine_overhead_s == (0.0, 0.0) and calibrated.stage_overhead(1) == pytest.approx((0.75, 2.0))


def test_stage_overhead_takes_each_rank_once():
    """A rank running two units counts once in the stage cost's median, as a rank with one does."""
    profile = synthetic_profile(forward=[1.0, 1.0, 1.0], backward=[2.0, 2.0, 2.0], params=[0] * 3, saved=[0] * 3,
                                cut_act=[8, 8], sizes=(1,), stage_overhead={1: (0.5, 1.0)})
    plan = plan_with(profile, [1], 1, 4, "gpipe")  # rank 0: one unit, rank 1: two
    calibrated = calibrate_profile(profile, [(plan, _fake_report(plan, [1.0, 2.0], [1.0, 3.0], 1.0))])
    assert calibrated.stage_overhead_s[1] == pytest.approx((0.5 * 1.5, 1.0 * 2.0))  # medians of [1, 2] and [1, 3]


def test_calibration_recomputes_predictions_from_the_profile_it_corrects():
    """A run planned from another measurement of the model (here 2x slower) calibrates this profile
    as a run planned from it does: the measured times are what count."""
    profile, other = _two_unit_profile(), _two_unit_profile(2.0)
    own, foreign = plan_with(profile, [1], 1, 4, "gpipe"), plan_with(other, [1], 1, 4, "gpipe")
    measured = _fake_report(own, [1.5, 1.5], [1.5, 1.5], 20.0)
    # the same measured seconds, reported against the other profile's plan
    from_other = _fake_report(foreign, [0.75, 0.75], [0.75, 0.75], 20.0)
    a = calibrate_profile(profile, [(own, measured)])
    b = calibrate_profile(profile, [(foreign, from_other)])
    assert [u.forward_s[1] for u in a.units] == pytest.approx([u.forward_s[1] for u in b.units])
    assert [u.forward_s[1] for u in a.units] == pytest.approx([1.5, 3.0])
    assert a.extra["calibration"]["step_overhead_s"] == pytest.approx(b.extra["calibration"]["step_overhead_s"])


def test_calibration_separates_per_step_overhead_from_latency_over_runs():
    profile = _two_unit_profile()
    one = [plan_with(profile, [], 1, m, "gpipe") for m in (2, 4, 8)]
    overhead = 0.7
    runs = [(p, _fake_report(p, [1.0], [1.0], simulate_plan(p).iteration_s + overhead + noise))
            for p, noise in zip(one, (0.0, 0.05, -0.05))]
    c = calibrate_profile(profile, runs).extra["calibration"]
    assert c["step_overhead_s"] == pytest.approx(overhead, abs=1e-9)  # the median residual
    two = [plan_with(profile, [1], 1, m, "gpipe") for m in (2, 8)]
    slow = [(p, _fake_report(p, [1.0, 1.0], [1.0, 1.0], simulate_plan(p).iteration_s + 0.1 * m))
            for p, m in zip(two, (2, 8))]
    c2 = calibrate_profile(profile, slow).extra["calibration"]
    assert c2["latency_s"] > 0  # what grows with the messages becomes latency, not per-step overhead
    assert c2["step_overhead_s"] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="at least one run"):
        calibrate_profile(profile, [])


def test_host_slowdown_and_its_warning():
    assert reference_kernel_s(0.01) > 0 and reference_kernel_s(0.01, device="meta") is None
    assert host_slowdown(None, [[1.0]]) is None and host_slowdown(1.0, [[None, None]]) is None
    quiet = host_slowdown(1e-4, [[1.0e-4, 1.02e-4], [0.99e-4, 1.01e-4]])
    assert quiet["slowest"] == pytest.approx(1.01) and quiet["fastest"] == pytest.approx(1.0)
    assert slowdown_warning(quiet) is None
    spell = host_slowdown(1e-4, [[1.0e-4, 1.0e-4], [1.3e-4, 1.2e-4]])
    assert spell["per_rank"] == pytest.approx([1.0, 1.25])
    assert "x1.25" in slowdown_warning(spell) and "rank 1" in slowdown_warning(spell)
    assert "faster" in slowdown_warning(host_slowdown(1e-4, [[0.8e-4]]))


def test_prediction_at_the_runs_host_speed():
    """The plan's prediction scaled by the slowest rank's kernel ratio, and its error against the
    measured iteration: what is left of the error once the host's drift is taken out."""
    spell = host_slowdown(1e-4, [[1.0e-4, 1.0e-4], [1.3e-4, 1.2e-4]])  # rank 1 at x1.25
    assert at_host_speed(0.040, spell) == pytest.approx(0.050)
    assert at_host_speed(0.040, None) is None
    lines = host_speed_lines(spell, 0.040, 0.051)
    assert any("predicts 50.00 ms (x1.25): error +2.0%" in line for line in lines)
    assert lines[-1].startswith("warning: ")
    assert not any("predicts" in line for line in host_speed_lines(spell))  # nothing to compare
    assert host_speed_lines(None, 0.040, 0.051) == []


def test_check_and_calibrate_commands_on_a_real_run(tmp_path):
    from planner.jsonio import write_json_atomic
    from planner.plan.file import save_plan
    from planner.profile.profile import save_profile

    profile = profile_of("builtin:gpt")
    plan = plan_with(profile, [4], 2, 8)
    execute(plan, tmp_path, steps=3)
    plan_path, profile_path = str(tmp_path / "plan.json"), str(tmp_path / "profile.json")
    save_profile(profile, profile_path)
    save_plan(plan, plan_path)
    report_path = str(tmp_path / "report.json")
    link = report_of(tmp_path)["link"]  # marked flat when a loaded host's ping-pong times did not grow with size
    assert link["bandwidth_bytes_per_s"] > 0 and link["p2p"] in ("shared memory", "gloo")
    checked = run_cli(["planner.cli", "check", plan_path, report_path])
    assert checked.returncode == 0, checked.stderr
    assert "iteration: measured" in checked.stdout and "another plan file" not in checked.stderr
    other_path = str(tmp_path / "other_plan.json")  # the same split, other predictions: checked, with a warning
    save_plan(dataclasses.replace(plan, predicted_iteration_s=plan.predicted_iteration_s * 2), other_path)
    other = run_here(["planner.cli", "check", other_path, report_path])
    assert other.returncode == 0 and other.stderr.count("another plan file") == 1, other.stderr
    # every rank timed the host-speed kernel before and after its steps; the profile did too
    # the bytes held for backward, counted by saved-tensor hooks in the first step, are the plan's
    # activation memory (1F1B: stage s holds p - s micro-batches at its peak)
    for stage in report_of(tmp_path)["stages"]:
        # (measured here: stage 0 1,188,480 B against 1,185,312 predicted, +0.27 %; stage 1 equal)
        assert stage["peak_saved_bytes"] == pytest.approx(stage["predicted_activation_bytes"], rel=0.01)
        assert stage["peak_saved_bytes"] > 0
    slow = report_of(tmp_path)["host_slowdown"]
    assert len(slow["per_rank"]) == 2 and all(r > 0 for r in slow["per_rank"])
    assert "host speed during the run" in checked.stdout
    scaled = at_host_speed(plan.predicted_iteration_s, slow)
    assert f"at the run's host speed the plan predicts {scaled * 1e3:.2f} ms" in checked.stdout
    printed = (tmp_path / "execute.out").read_text()  # what `runtime execute` printed for this run
    assert "host speed during the run" in printed
    assert f"at the run's host speed the plan predicts {scaled * 1e3:.2f} ms" in printed
    out = str(tmp_path / "calibrated.json")
    calibrated = run_here(["planner.cli", "calibrate", profile_path, report_path, report_path, "--plan", plan_path,
                           "-o", out])
    assert calibrated.returncode == 0, calibrated.stderr
    assert "per-step overhead" in calibrated.stdout and "from 2 run(s)" in calibrated.stdout
    mismatched = run_here(["planner.cli", "calibrate", profile_path, report_path, report_path, report_path,
                           "--plan", plan_path, "--plan", plan_path, "-o", str(tmp_path / "no.json")])
    assert mismatched.returncode != 0 and "one per report" in mismatched.stderr
    assert not (tmp_path / "no.json").exists()
    # bad input: one line and exit 2, never a traceback
    not_a_report = run_here(["planner.cli", "check", plan_path, profile_path])
    assert not_a_report.returncode == 2 and "not a run report" in not_a_report.stderr
    other = json.load(open(report_path))
    other["model"] = dict(other["model"], entry="builtin:mlp")
    other_path = str(tmp_path / "other.json")
    write_json_atomic(other_path, other)
    for args in (["check", plan_path, other_path],
                 ["calibrate", profile_path, other_path, "--plan", plan_path, "-o", str(tmp_path / "no.json")]):
        wrong = run_here(["planner.cli", *args])
        assert wrong.returncode == 2 and "different model" in wrong.stderr and "Traceback" not in wrong.stderr
    assert not (tmp_path / "no.json").exists()
    # a plan of another model, which the report did not run: the refusal alone (the twenty-ninth session's fuzz:
    # the warning that the report is of another plan file came first, two lines)
    other_model = str(tmp_path / "other_model.json")
    save_plan(dataclasses.replace(plan, model=dict(plan.model, seed=plan.model.get("seed", 0) + 1)), other_model)
    wrong = run_here(["planner.cli", "calibrate", profile_path, report_path, "--plan", other_model, "-o",
                      str(tmp_path / "no.json")])
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "different model" in wrong.stderr, wrong.stderr
    assert not (tmp_path / "no.json").exists()
    assert "calibration" in json.load(open(out))
    simulated = run_here(["planner.cli", "simulate", plan_path, "--timeline", str(tmp_path / "sim.png")])
    assert simulated.returncode == 0, simulated.stderr
    assert "simulated iteration" in simulated.stdout and (tmp_path / "sim.png").exists()


def test_a_report_whose_fields_are_broken_is_one_line(tmp_path):
    from planner.fidelity.check import load_report
    from planner.jsonio import JsonFileError, write_json_atomic

    good = {"schema_version": 1, "kind": "report", "measured_iteration_s": 0.01, "predicted_iteration_s": 0.01,
            "stages": [{"rank": 0, "units": ["a"], "measured": {"forward_s": 1e-3, "backward_s": 2e-3},
                        "predicted": {"forward_s": 1e-3, "backward_s": 2e-3}}]}
    path = str(tmp_path / "r.json")
    write_json_atomic(path, good)
    assert load_report(path) == good
    for mutate, needle in ((lambda r: r.update(stages="x"), "no list of ranks"),
                           (lambda r: r["stages"][0].pop("rank"), "stages[0] has no rank"),
                           (lambda r: r["stages"][0]["measured"].update(forward_s="x"), "lacks forward_s"),
                           (lambda r: r["stages"][0].update(chunks=[-1]), "chunks is not a list of stage indices"),
                           (lambda r: r.update(measured_iteration_s=float("nan")), "measured_iteration_s"),
                           (lambda r: r.update(host_slowdown={"fastest": 1.0, "slowest": 0}), "host_slowdown"),
                           (lambda r: r.update(link="x"), "link that is not an object"),
                           # found by a fuzz of every command: each was a traceback or a misleading line
                           (lambda r: r.update(host_slowdown={"fastest": 1.0, "slowest": 1.0, "per_rank": "x"}),
                            "ratios > 0 per rank"),
                           (lambda r: r.update(host_slowdown={"fastest": 0.8, "slowest": 0.9, "per_rank": [1.0]}),
                            "fastest and slowest among them"),
                           (lambda r: r.update(link={"latency_s": None, "bandwidth_bytes_per_s": "x"}),
                            "link.bandwidth_bytes_per_s"),
                           (lambda r: r.update(micro_batch_size="x"), "micro_batch_size 'x'"),
                           (lambda r: r["stages"].append(dict(r["stages"][0])), "names one rank twice"),
                           (lambda r: r.update(schema_version=99), "schema_version 99"),
                           (lambda r: r.pop("schema_version"), "schema_version None"),
                           # the twenty-sixth session's fuzz: calibrate's KeyError, a flag read as version 1
                           (lambda r: r["stages"][0].pop("units"), "stages[0].units is not a list of names"),
                           (lambda r: r.update(schema_version=True), "schema_version True")):
        bad = json.loads(json.dumps(good))
        mutate(bad)
        write_json_atomic(path, bad)
        with pytest.raises(JsonFileError, match=re.escape(needle)):
            load_report(path)
