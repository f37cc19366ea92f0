"""Importing PipeDream's published graphs: units, times, crossing tensors, and planning the result."""
import os
import re

import pytest

from planner.cli.main import main
from planner.cost.options import CostOptions
from planner.profile.pipedream import graph_to_profile, import_pipedream, parse_graph
from planner.profile.profile import load_profile
from planner.solve.api import solve

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "gnmt.graph.txt")

DIAMOND = """node1 -- Input0 -- forward_compute_time=5.000, backward_compute_time=0.000, activation_size=400.0, parameter_size=0.000
node2 -- Conv2d(3, 8) -- forward_compute_time=1.000, backward_compute_time=2.000, activation_size=800.0, parameter_size=96.000
node4 -- ReLU -- forward_compute_time=0.500, backward_compute_time=0.500, activation_size=[800.0; 16.0], parameter_size=0.000
node3 -- Conv2d(8, 8) -- forward_compute_time=1.500, backward_compute_time=3.000, activation_size=800.0, parameter_size=64.000
node5 -- Add -- forward_compute_time=0.100, backward_compute_time=0.100, activation_size=800.0, parameter_size=0.000
\tnode1 -- node2
\tnode2 -- node3
\tnode2 -- node4
\tnode4 -- node5
\tnode3 -- node5
"""


def test_diamond_conversion():
    nodes, edges = parse_graph(DIAMOND)
    p = graph_to_profile(nodes, edges, 32, "diamond")
    assert [u.name for u in p.units] == ["node1", "node2", "node4", "node3", "node5"]  # topological, file order
    first = p.units[0]
    assert first.forward_s[32] == 0.0 and first.saved_bytes[32] == 0  # Input costs nothing
    assert p.units[1].forward_s[32] == pytest.approx(1e-3) and p.units[1].backward_s[32] == pytest.approx(2e-3)
    assert p.units[1].param_bytes == 96 and p.units[2].saved_bytes[32] == 816
    assert p.cut(1).activation_bytes(32) == 0  # only the model input crosses: never sent
    assert [v.name for v in p.cut(2).values] == ["node2"]
    # cut 3 (before node3): node2 still feeds node3, node4's two outputs feed node5
    assert sorted(v.name for v in p.cut(3).values) == ["node2", "node4:0", "node4:1"]
    assert p.cut(3).activation_bytes(32) == 800 + 800 + 16
    assert sorted(v.name for v in p.cut(4).values) == ["node3", "node4:0", "node4:1"]


def test_bad_graphs_are_rejected():
    with pytest.raises(ValueError, match="line 1"):
        parse_graph("node1 -- Conv -- forward_compute_time=1.0\n")
    with pytest.raises(ValueError, match="unknown node"):
        parse_graph(DIAMOND + "\tnode5 -- node9\n")
    for bad in ("forward_compute_time=-1.000", "parameter_size=1e400", "activation_size=-4.0"):
        key = bad.split("=")[0]
        line = re.sub(key + r"=[^,]*", bad, DIAMOND.splitlines()[1], count=1)
        with pytest.raises(ValueError, match="line 2: times and sizes must be finite and >= 0"):
            parse_graph("\n".join([DIAMOND.splitlines()[0], line] + DIAMOND.splitlines()[2:]))
    with pytest.raises(ValueError, match="cycle"):
        nodes, edges = parse_graph(DIAMOND + "\tnode5 -- node2\n")
        graph_to_profile(nodes, edges, 1, "x")
    with pytest.raises(ValueError, match="line 3: node 'node2' is named twice"):  # the profile would refuse it
        lines = DIAMOND.splitlines()
        parse_graph("\n".join(lines[:2] + [lines[1]] + lines[2:]))


def test_gnmt_imports_and_plans(tmp_path, capsys):
    out = str(tmp_path / "gnmt.json")
    assert main(["import-pipedream", DATA, "--batch-size", "64", "--output", out]) == 0
    p = load_profile(out)
    assert p.num_units == 48 and p.micro_batch_sizes == [64]
    assert max(len(c.values) for c in p.cuts) >= 3  # LSTM outputs and skip connections cross cuts
    for S in (2, 4, 8):
        found = solve(p, CostOptions(pipeline_ranks=S, global_batch=64 * 4 * S))
        assert found.status == "optimal" and found.gap == 0.0 and found.seconds < 10
        fast = solve(p, CostOptions(pipeline_ranks=S, global_batch=64 * 4 * S), method="dp")
        assert found.objective * (1 - 1e-9) <= fast.objective <= found.objective * 1.02  # the starts are near
    assert import_pipedream(DATA, 64).units[0].forward_s[64] == 0.0


def test_a_plan_of_an_imported_profile_is_refused_by_execute_before_any_rank_starts(tmp_path, capsys):
    # the twenty-sixth session's fuzz: the ranks started, and each failed on "cannot import 'pipedream'"
    from runtime.cli import main as runtime_main

    profile, plan = str(tmp_path / "gnmt.json"), str(tmp_path / "plan.json")
    assert main(["import-pipedream", DATA, "--batch-size", "64", "--output", profile]) == 0
    assert main(["solve", profile, "--stages", "2", "--global-batch", "128", "-o", plan]) == 0
    capsys.readouterr()
    assert runtime_main(["execute", plan, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the plan has no model to build (model entry 'pipedream:" in err
    assert runtime_main(["show", plan]) == 0  # its lists still show
