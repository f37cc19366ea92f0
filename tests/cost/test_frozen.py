"""Frozen parameters (requires_grad=False) in the profile, the memory model and the solvers: weights
only, no gradient, master weight or optimizer state, nothing to exchange across replicas."""
import dataclasses
import json

import pytest

from planner.cost.model import evaluate
from planner.cost.options import CostOptions
from planner.jsonio import JsonFileError
from planner.profile.profile import Profile
from planner.solve.api import solve
from planner.solve.diagnose import InfeasibleError
from tests.support.synthetic import synthetic_profile

PARAMS = [4000, 8000, 8000, 4000]  # bytes, fp32: 1000, 2000, 2000, 1000 parameters
TRAINABLE = [0, 800, 800, 4000]  # the embedding frozen, adapters on the middle units, the head trained


def _profile(trainable=None):
    profile = synthetic_profile(forward=[1e-3] * 4, backward=[2e-3] * 4, params=PARAMS, saved=[400] * 4,
                                cut_act=[80] * 3, sizes=(1, 2))
    if trainable is None:
        return profile
    units = [dataclasses.replace(u, trainable_bytes=t) for u, t in zip(profile.units, trainable)]
    return dataclasses.replace(profile, units=units)


def _opts(**kw):
    base = dict(pipeline_ranks=2, global_batch=8, data_parallel=2, optimizer="adamw", dp_bandwidth=1e6,
                precision="fp32")
    base.update(kw)
    return CostOptions(**base)


def test_frozen_bytes_hold_weights_only():
    full, tuned = evaluate(_profile(), [2], 2, _opts()), evaluate(_profile(TRAINABLE), [2], 2, _opts())
    # stage 0: 3000 parameters, 200 of them trainable; fp32 AdamW: 4 B of weight each, 4 + 8 more if trainable
    st = tuned.stages[0]
    assert (st.param_bytes, st.grad_bytes, st.optimizer_bytes) == (12000, 800, 1600)
    assert full.device_memory[0] - tuned.device_memory[0] == 2800 * (4 + 8)
    assert tuned.stages[1].grad_bytes == 800 + 4000
    # ZeRO-1 over the 2 replicas: the trainable parameters' optimizer state halves, the weights stay
    sharded = evaluate(_profile(TRAINABLE), [2], 2, _opts(shard="optimizer"))
    assert tuned.device_memory[0] - sharded.device_memory[0] == 200 * 8 / 2


def test_only_trainable_gradients_are_exchanged():
    tuned = evaluate(_profile(TRAINABLE), [2], 2, _opts())
    assert tuned.durations[("reduce", 0)] == pytest.approx(200 * 2 * 0.5 * 4 / 1e6)  # all-reduce of 200 gradients
    # ZeRO-3 gathers every weight for each micro-batch's forward (m = 2), and again for its backward
    # where that runs: not the frozen embedding's (unit 0: nothing trains, its input has no gradient)
    zero3 = evaluate(_profile(TRAINABLE), [2], 2, _opts(shard="parameters"))
    frozen_gathers = (1000 * 1 + 1800 * 2) * 0.5 * 2 * 4  # unit 0's 1000 frozen parameters once, unit 1's 1800 twice
    assert zero3.durations[("reduce", 0)] == pytest.approx((200 * 0.5 * 2 * (4 + 2 * 4) + frozen_gathers) / 1e6)
    # every unit frozen up to the cut (no gradient crosses cuts 1 and 2): the stage's backward never
    # runs, one gather per forward
    head = synthetic_profile(forward=[1e-3] * 4, backward=[2e-3] * 4, params=PARAMS, saved=[400] * 4,
                             cut_act=[80] * 3, cut_grad=[0, 0, 80], sizes=(1, 2))
    head = dataclasses.replace(head, units=[dataclasses.replace(u, trainable_bytes=t)
                                            for u, t in zip(head.units, [0, 0, 800, 4000])])
    frozen = evaluate(head, [2], 2, _opts(shard="parameters"))
    assert frozen.durations[("reduce", 0)] == pytest.approx(3000 * 0.5 * 2 * 4 / 1e6)


@pytest.mark.parametrize("method", ["ilp", "dp", "brute"])
def test_a_fine_tune_fits_where_full_training_does_not(method):
    need = max(evaluate(_profile(), [2], 1, _opts(recompute="none")).device_memory)
    opts = _opts(memory_cap=need - 1, recompute="none")
    with pytest.raises(InfeasibleError):
        solve(_profile(), opts, method=method)
    found = solve(_profile(TRAINABLE), opts, method=method)
    assert found.cost.feasible and max(found.cost.device_memory) <= need - 1
    again = evaluate(_profile(TRAINABLE), found.boundaries, found.cost.micro_batch_size, found.options)
    assert again.device_memory == found.cost.device_memory


def test_profile_files_keep_trainable_bytes_and_older_ones_train_everything():
    tuned = _profile(TRAINABLE)
    back = Profile.from_json(json.loads(json.dumps(tuned.to_json())))
    assert [u.trainable_bytes for u in back.units] == TRAINABLE
    assert [u.frozen_bytes for u in back.units] == [p - t for p, t in zip(PARAMS, TRAINABLE)]
    old = tuned.to_json()
    for unit in old["units"]:
        del unit["trainable_bytes"]
    assert [u.trainable_bytes for u in Profile.from_json(old).units] == PARAMS
    bad = tuned.to_json()
    bad["units"][1]["trainable_bytes"] = 9000
    with pytest.raises(JsonFileError, match=r"units\[1\]\.trainable_bytes is 9000: more than"):
        Profile.from_json(bad)


def test_a_frozen_tie_is_not_all_reduced():
    profile = _profile()
    tie = {"name": "w", "names": ["w"], "units": ["u0", "u3"], "bytes": 4000}
    trained = dataclasses.replace(profile, extra={"shared_parameters": [tie]})
    frozen = dataclasses.replace(profile, extra={"shared_parameters": [dict(tie, trainable=False)]})
    opts = _opts(data_parallel=1, global_batch=4)
    assert ("tie", "w") in evaluate(trained, [2], 2, opts).durations
    assert ("tie", "w") not in evaluate(frozen, [2], 2, opts).durations


def test_a_stage_whose_input_needs_no_gradient_splits_its_backward_as_the_first_does():
    """Zero-bubble parts of a stage starting at a cut that carries no gradient (everything before it
    frozen): the runtime's input part has nothing to differentiate (planner.profile.splitgrad), so
    its weight part is the whole backward and holds all it saved and its outputs' gradient, as the
    first stage's; the matrices the solvers read say what the ranges do."""
    from planner.cost.ranges import RangeCosts

    profile = synthetic_profile(forward=[1e-3] * 4, backward=[2e-3] * 4, params=PARAMS, saved=[400] * 4,
                                cut_act=[80] * 3, cut_grad=[80, 0, 80], sizes=(1, 2))
    c = RangeCosts(profile, 2)
    assert list(c.whole) == [True, False, True, False, False]
    for a, e in [(0, 2), (2, 3), (2, 4)]:
        assert c.backward_input(a, e) == c.first_input
        assert c.backward_weight(a, e) == pytest.approx(c.first_call + c.G[e] - c.G[a])
        assert c.weight_held(a, e) == c.saved(a, e) + c.grad[e]
    assert c.weight_held(1, 3) != c.saved(1, 3) + c.grad[3]  # a later stage whose input needs a gradient
    backward_input, backward_weight = c.split_matrices(0.0)
    for a in range(4):
        for e in range(a + 1, 5):
            assert backward_input[a, e] == pytest.approx(c.backward_input(a, e))
            assert backward_weight[a, e] == pytest.approx(c.backward_weight(a, e))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_recompute_all_leaves_a_unit_without_a_backward_alone(schedule):
    # unit 0 (the frozen embedding) trains nothing, reads no value carrying a gradient and saves nothing: its
    # backward needs nothing. Under --recompute all every solver recomputed it all the same (its forward, 50 ms here, run again
    # and its inputs kept); now none does, and a plan and its bound are those of every other unit recomputed
    from planner.solve.brute import solve_brute
    from planner.solve.replicas import busy_bound
    from planner.solve.scenario_bound import scenario_lower_bound

    profile = _profile(TRAINABLE)
    nothing = {1: 0, 2: 0}  # (autograd builds no graph for it)
    profile = dataclasses.replace(profile, units=[dataclasses.replace(profile.units[0], forward_s={1: 5e-2, 2: 5e-2},
                                                                      saved_bytes=nothing, weight_held_bytes=nothing),
                                                  *profile.units[1:]])
    opts = _opts(data_parallel=1, schedule=schedule, recompute="all")
    # the range terms themselves (evaluate drops such a unit from its lists before they are read): recomputing
    # unit 0 costs nothing again and its backward is that of unit 0 not recomputed
    from planner.cost.ranges import range_costs

    terms = range_costs(profile, 2)
    assert not terms.recomputable[0] and terms.recomputable[1] and terms.again[0] == 0 < terms.again[1]
    assert terms.backward(0, 2, recompute=[0, 1]) == terms.backward(0, 2, recompute=[1])
    others = evaluate(profile, [2], 2, opts, [1, 2, 3])
    every = evaluate(profile, [2], 2, opts, [0, 1, 2, 3])
    assert [st.recompute for st in every.stages] == [[1], [2, 3]]
    assert every.iteration_s == others.iteration_s and every.device_memory == others.device_memory
    oracle = solve_brute(profile, opts)
    # the bounds of every plan (they charged its forward again: 0.416 s against a 0.254 s optimum under 1f1b)
    assert scenario_lower_bound(profile, 2, opts) <= oracle.objective * (1 + 1e-9)
    assert busy_bound(profile, 2, opts) <= oracle.objective * (1 + 1e-9)
    for method in ("ilp", "dp"):
        found = solve(profile, opts, method=method)
        assert 0 not in [l for st in found.cost.stages for l in st.recompute]
        assert found.objective >= oracle.objective * (1 - 1e-9)  # a plan, never below the optimum
        assert found.objective == pytest.approx(oracle.objective, rel=1e-9) or method == "dp"
        assert found.bound <= oracle.objective * (1 + 1e-9)
