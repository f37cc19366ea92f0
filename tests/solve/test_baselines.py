"""Baselines: their splits follow their tools' rules, and the ILP is never worse than any of them."""
import pytest

from planner.cli.main import main
from planner.cost.options import CostOptions
from planner.profile.profile import save_profile
from planner.solve.api import solve
from planner.solve.baselines import balanced_split, uniform_split
from planner.solve.diagnose import InfeasibleError
from tests.support.synthetic import synthetic_profile


def lopsided():
    # a light embedding, heavy middle blocks, a parameter-heavy head (DeepSpeed #2974's complaint)
    return synthetic_profile([0.001, 0.01, 0.01, 0.01, 0.01, 0.004], [0.002, 0.02, 0.02, 0.02, 0.02, 0.008],
                             [1 << 20, 2 << 20, 2 << 20, 2 << 20, 2 << 20, 24 << 20], [1 << 16] * 6, [1 << 12] * 5,
                             sizes=(1, 2, 4))


def test_uniform_and_balanced_splits():
    assert uniform_split(10, 4) == [3, 6, 8]
    assert uniform_split(8, 4) == [2, 4, 6]
    assert balanced_split([1, 1, 1, 10], 2) == [3]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [1]


@pytest.mark.parametrize("method", ["uniform", "params", "block"])
def test_ilp_never_worse_than_a_baseline(method):
    p = lopsided()
    opts = CostOptions(pipeline_ranks=3, global_batch=8)
    ilp = solve(p, opts)
    base = solve(p, opts, method=method)
    assert base.status == "heuristic" and base.cost.feasible
    assert ilp.objective <= base.objective * (1 + 1e-9)


def test_params_baseline_isolates_the_heavy_head_and_loses_time():
    p = lopsided()
    opts = CostOptions(pipeline_ranks=2, global_batch=8)
    base = solve(p, opts, method="params")
    assert base.boundaries == [5]  # the 24 MiB head alone outweighs everything else
    assert solve(p, opts).objective < 0.8 * base.objective


def test_baseline_that_does_not_fit_is_infeasible():
    p = lopsided()
    opts = CostOptions(pipeline_ranks=2, global_batch=8, memory_cap=50 << 20)
    ilp = solve(p, opts)
    assert ilp.cost.feasible
    with pytest.raises(InfeasibleError):
        solve(p, opts, method="uniform")  # [3] puts 56 MiB of parameters on the last device


def test_compare_prints_every_method(tmp_path, capsys):
    path = str(tmp_path / "p.json")
    save_profile(lopsided(), path)
    assert main(["compare", path, "--stages", "2", "--global-batch", "8", "--memory-per-device", "50MiB"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[0] == "method"
    for name in ("ilp", "uniform", "params", "block"):
        assert any(line.split()[0] == name for line in lines[2:] if line.split())
    assert "1.000x" in out and "no" in out


def test_compare_replicate_adds_the_replicated_optimum(tmp_path, capsys):
    """One unit holds most of the work: with --replicate, compare adds the optimum that runs it on
    several devices, and it is faster than the best unreplicated split (the ILP row)."""
    from planner.solve.replicas import solve_replicated

    p = synthetic_profile([0.001, 0.001, 0.02], [0.002, 0.002, 0.04], [1 << 16] * 3, [1 << 12] * 3, [1 << 10] * 2,
                          sizes=(1, 2, 4))
    path = str(tmp_path / "p.json")
    save_profile(p, path)
    assert main(["compare", path, "--stages", "3", "--global-batch", "8", "--replicate"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:] if line.split()}
    opts = CostOptions(pipeline_ranks=3, global_batch=8)
    replicated = solve_replicated(p, opts, [opts, opts.with_(schedule="gpipe")])
    label = "/".join(str(st.replicas) for st in replicated.cost.stages)
    assert rows["replicas"][1] == label and max(st.replicas for st in replicated.cost.stages) > 1
    assert float(rows["replicas"][2]) == pytest.approx(replicated.objective * 1e3, abs=1e-3)
    ilp_ms = float(rows["ilp"][1])
    assert float(rows["replicas"][2]) < ilp_ms
    assert float(rows["replicas"][-1].rstrip("x")) == pytest.approx(replicated.objective * 1e3 / ilp_ms, abs=2e-3)


def test_compare_replicate_under_an_unsupported_schedule_keeps_the_table(tmp_path, capsys):
    path = str(tmp_path / "p.json")
    save_profile(lopsided(), path)
    assert main(["compare", path, "--stages", "2", "--global-batch", "8", "--replicate",
                 "--schedule", "interleaved", "--virtual-stages", "2"]) == 0
    out = capsys.readouterr().out
    assert "replicas: not available: --replicate needs --schedule 1f1b, gpipe or auto" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.split()}
    assert rows["replicas"][-1] == "-" and rows["ilp"][-1] == "1.000x"


def test_compare_plans_what_solve_plans_on_a_topology_and_with_local_sgd(tmp_path, capsys):
    """compare's ilp row is planner solve's plan for the same flags (--topology, --local-sgd-max),
    and the baselines are solved on the same problem."""
    import json

    path = str(tmp_path / "p.json")
    save_profile(lopsided(), path)
    topology = tmp_path / "sites.json"
    topology.write_text(json.dumps({"levels": [{"count": 2, "bandwidth": "10MB", "latency": 1e-3}, {"count": 2}]}))
    plan = str(tmp_path / "plan.json")
    for flags in (["--topology", str(topology)],
                  ["--devices", "4", "--local-sgd-max", "8", "--dp-bandwidth", "1MB", "--bandwidth", "1kB"]):
        assert main(["solve", path, "--global-batch", "8", "-o", plan] + flags) == 0
        solved = json.loads(open(plan).read())
        capsys.readouterr()
        assert main(["compare", path, "--global-batch", "8"] + flags) == 0
        out = capsys.readouterr().out
        rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.split()}
        assert float(rows["ilp"][1]) == pytest.approx(solved["predicted_iteration_s"] * 1e3, abs=1e-3), (flags, out)
        assert f"p {solved['pipeline_stages']} x d {solved['data_parallel']}" in out
        for name in ("uniform", "params", "block"):
            assert rows[name][4] == "yes" and float(rows[name][-1].rstrip("x")) >= 1.0 - 1e-3, (flags, out)


def test_compare_counts_the_units_the_plan_recomputes(tmp_path, capsys):
    # under --recompute all the solver names every unit, a frozen embedding that saves nothing too, which the
    # plan never recomputes (its backward needs nothing: RangeCosts.recomputable): compare counted it
    import dataclasses

    p = lopsided()
    nothing = {b: 0 for b in p.micro_batch_sizes}
    p = dataclasses.replace(p, units=[dataclasses.replace(p.units[0], trainable_bytes=0, saved_bytes=nothing,
                                                          weight_held_bytes=nothing), *p.units[1:]])
    path = str(tmp_path / "p.json")
    save_profile(p, path)
    opts = CostOptions(pipeline_ranks=2, global_batch=8, recompute="all")
    best = solve(p, opts)
    assert sorted(best.recompute) == list(range(p.num_units))  # the solver's list names every unit
    assert main(["compare", path, "--stages", "2", "--global-batch", "8", "--recompute", "all"]) == 0
    assert f"{p.num_units - 1} units recomputed" in capsys.readouterr().out
