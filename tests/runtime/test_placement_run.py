"""A plan placed on a leveled topology (issue 22): the runtime runs replica r's pipeline rank i as
the global rank the plan's placement gives, holds messages and exchanges crossing the emulated
site link for their planned time, trains exactly like one process, and is predicted within 15 %."""
import json

import pytest

from planner.model.entry import build_spec
from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.cost.placement import Placement
from planner.cost.topology_file import topology_from_json
from planner.jsonio import JsonFileError
from planner.plan.file import Plan
from planner.plan.make import make_plan
from planner.solve.solution import Solution
from runtime.torch_engine import refusal
from tests.support.runs import execute, max_abs_diff, profile_of, reference_state, report_of

# a slow enough site link that its messages and exchanges dominate the step on a loaded host
SITES = {"levels": [{"name": "site", "count": 2, "bandwidth": "2MB", "latency": 0.05, "emulate": True},
                    {"name": "device", "count": 2}]}
MLP = {"layers": 4}
# both replicas' pipelines cross sites, and so do both ranks' exchanges; no rank is where the launcher puts it
DEVICES = ((0, 2), (3, 1))


def _plan(devices=DEVICES, b=2, g=16):
    profile = profile_of("builtin:mlp", MLP, sizes=(b,))
    placement = Placement(topology_from_json(SITES), devices)
    opts = CostOptions(pipeline_ranks=len(devices[0]), global_batch=g, data_parallel=len(devices),
                       placement=placement)
    cost = evaluate(profile, [2], b, opts)
    solution = Solution(boundaries=[2], micro_batch_size=b, num_micro_batches=cost.num_micro_batches, cost=cost,
                        status="fixed", objective=cost.iteration_s, bound=cost.iteration_s, gap=0.0, seconds=0.0,
                        method="fixed", backend="none", options=opts)
    return make_plan(profile, solution, opts, "test")


def test_the_plan_states_the_placement_and_the_runtime_follows_it():
    plan = _plan()
    assert plan.placement == [[0, 2], [3, 1]] and plan.emulated_boundaries == [0]
    # both exchanges cross the site link only: the whole planned exchange is held
    assert plan.emulated_exchange_s == pytest.approx(plan.step_durations["reduce"]) and min(plan.emulated_exchange_s) > 0
    topology = Plan.from_json(plan.to_json()).topology()
    assert [(topology.replica_of(r), topology.pipeline_rank_of(r)) for r in range(4)] == [(0, 0), (1, 1), (0, 1), (1, 0)]
    assert topology.global_rank(1, 0) == 3 and topology.data_parallel_group(0) == [0, 3]
    assert "ranks placed on chosen devices" in refusal(plan)
    # the launcher's own order is no placement
    assert _plan(((0, 1), (2, 3))).topology().placement is None
    for bad in ([[0, 2], [3, 3]], [[0, 1, 2, 3]], "0,1"):
        with pytest.raises(JsonFileError, match="placement"):
            Plan.from_json(dict(plan.to_json(), placement=bad))
    with pytest.raises(JsonFileError, match="emulated_exchange_s"):
        Plan.from_json(dict(plan.to_json(), emulated_exchange_s=[0.1]))


def test_a_placed_run_over_an_emulated_link_trains_like_one_process_and_is_predicted(tmp_path):
    plan = _plan()
    trace = str(tmp_path / "trace.json")
    state = execute(plan, tmp_path, steps=3, extra=["--trace", trace])
    assert max_abs_diff(state, reference_state(plan, steps=3)) <= 1e-5
    initial = build_spec("builtin:mlp", MLP, 0).module.state_dict()
    assert max_abs_diff(state, dict(initial)) > 1e-4  # it trained
    # each global rank ran the stage its place gives it: ranks 0 and 3 stage 0, ranks 1 and 2 stage 1
    with open(trace) as f:
        ran = {(e["tid"], e["args"]["stage"]) for e in json.load(f)["traceEvents"] if e.get("cat") == "forward"}
    assert ran == {(0, 0), (3, 0), (1, 1), (2, 1)}
    said = (tmp_path / "execute.out").read_text()
    assert "placement: replica 0 on ranks 0 2; replica 1 on ranks 3 1" in said and "gradient exchange" in said
    report = report_of(tmp_path)
    predicted = report["predicted_iteration_s"]
    measured = min(step["time_s"] for step in report["steps"])  # a loaded host only adds time
    assert predicted > 0.3
    assert abs(measured - predicted) / predicted < 0.15, (measured, predicted)
