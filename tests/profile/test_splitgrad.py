"""planner/profile/splitgrad.py: a backward in two parts gives the whole backward's gradients, computes no
weight gradient in its first part, and accumulates like backward (hooks included); the data-parallel
buckets of a zero-bubble list are armed at the last weight backward."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from planner.pipeline.actions import ActionKind
from planner.pipeline.schedule import build_schedule
from runtime.groups import last_backwards
from planner.cost.ranges import range_costs
from planner.profile.splitgrad import backward_input, backward_weight


class _Stage(nn.Module):
    """A middle stage: a recomputable block, a branch that no input reaches, an input passed on."""

    def __init__(self, recompute: bool):
        super().__init__()
        self.a, self.b, self.c, self.side = nn.Linear(4, 6), nn.Linear(6, 4), nn.Linear(4, 4), nn.Linear(3, 4)
        self.recompute = recompute

    def forward(self, x, z):
        block = lambda t: torch.tanh(self.a(t))  # noqa: E731
        h = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        y = self.b(h) + self.side(z)
        return y * 2, self.c(y).relu() + x, x


class _Matmuls(TorchDispatchMode):
    """Counts the multiply-adds of the matrix products run under it (a backward's real work)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2], args[-1]
            self.flops += a.shape[0] * a.shape[1] * b.shape[1]
        return out


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("input_grad", [True, False])
def test_two_parts_give_the_whole_backward(recompute, input_grad):
    torch.manual_seed(0)
    split_model = _Stage(recompute)
    whole_model = copy.deepcopy(split_model)
    x, z = torch.randn(3, 4), torch.randn(3, 3)
    grads = [torch.randn(3, 4) for _ in range(3)]
    hooked = []
    for p in split_model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: hooked.append(p))

    x1 = x.clone().requires_grad_(input_grad)
    out = split_model(x1, z)
    with _Matmuls() as first:
        pending = backward_input(out, grads, [x1], list(split_model.parameters()))
    assert all(p.grad is None for p in split_model.parameters()) and not hooked  # nothing accumulated yet
    input_grad_after_first_part = x1.grad
    with _Matmuls() as second:
        backward_weight(pending)

    x2 = x.clone().requires_grad_(input_grad)
    pairs = [(out, g) for out, g in zip(whole_model(x2, z), grads) if out.requires_grad]
    with _Matmuls() as whole:
        torch.autograd.backward([out for out, _ in pairs], [g for _, g in pairs])
    # no weight gradient computed in the first part (and none twice): the parts' matmuls are the whole's,
    # plus the checkpointed block's forward where each part recomputes it (splitgrad's docstring)
    with torch.no_grad(), _Matmuls() as block:
        split_model.a(x)
    assert first.flops + second.flops == whole.flops + (block.flops if recompute and input_grad else 0)
    assert (first.flops > 0) == input_grad
    for p, q in zip(split_model.parameters(), whole_model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    assert len(hooked) == len(list(split_model.parameters()))  # as backward: each parameter's hook once
    if input_grad:
        assert torch.allclose(input_grad_after_first_part, x2.grad, atol=1e-6)


def test_the_parts_of_one_node_reaching_no_input_keep_their_own_gradients():
    # a later stage whose outputs include a chunk's parts made from its parameters alone (no input reaches
    # them): one autograd node, two outputs. Their seeds were taken as one output's, the sum of both
    # gradients on one part, and the weight part gave the chunk's source a wrong gradient (5e-4 off in a
    # run of a frozen-conditioned model under ZB-H1)
    torch.manual_seed(0)
    lin, mod = nn.Linear(4, 4), nn.Linear(3, 8)
    x, c = torch.randn(2, 4, requires_grad=True), torch.randn(2, 3)  # c needs no gradient
    whole_model = copy.deepcopy((lin, mod))
    grads = [torch.randn(2, 4) for _ in range(3)]

    def run(lin, mod, x):
        shift, scale = mod(c).chunk(2, dim=-1)
        return [lin(x), shift, scale]

    outs = run(*whole_model, x.detach().clone().requires_grad_())
    torch.autograd.backward(outs, grads)
    outs = run(lin, mod, x)
    pending = backward_input(outs, grads, [x], [*lin.parameters(), *mod.parameters()])
    backward_weight(pending)
    for split, whole in zip([*lin.parameters(), *mod.parameters()], [*whole_model[0].parameters(),
                                                                     *whole_model[1].parameters()]):
        assert torch.equal(split.grad, whole.grad)


def test_buckets_are_armed_at_the_last_weight_backward():
    lists = build_schedule("zb-h1", 2, 4)
    stage = SimpleNamespace(module=nn.Linear(2, 2))  # what last_backwards reads of a stage
    arming = last_backwards(lists[0], {0: stage}, tied=set())
    last_w = max(k for k, a in enumerate(lists[0]) if a.kind is ActionKind.BACKWARD_WEIGHT)
    assert list(arming) == [(0, lists[0][last_w].micro_batch)]
    assert {id(p) for p in arming[(0, lists[0][last_w].micro_batch)]} == {id(p) for p in stage.module.parameters()}


def test_profile_split_fields_round_trip_and_older_profiles_are_estimated():
    import json

    from planner.cost.ranges import WEIGHT_SHARE, range_costs
    from planner.profile.profile import Profile
    from tests.support.synthetic import synthetic_profile

    old = synthetic_profile(forward=[1.0, 1.0], backward=[2.0, 4.0], params=[8, 8], saved=[100, 60], cut_act=[8],
                            sizes=(1,))
    costs = range_costs(old, 1)
    assert list(costs.gw) == [2.0 * WEIGHT_SHARE, 4.0 * WEIGHT_SHARE] and list(costs.gi + costs.gw) == [2.0, 4.0]
    assert list(costs.h) == [100.0, 60.0]  # everything saved held until the weight part: an upper bound
    unit = old.units[1]
    unit.backward_input_s, unit.backward_weight_s, unit.weight_held_bytes = {1: 3.0}, {1: 1.0}, {1: 20}
    again = Profile.from_json(json.loads(json.dumps(old.to_json())))
    assert again.units[1].backward_weight_s == {1: 1.0} and again.units[1].weight_held_bytes == {1: 20}
    assert not again.units[0].split_backward and "backward_weight_s" not in again.units[0].to_json()
    costs = range_costs(again, 1)
    assert costs.backward_input(1, 2) == 3.0 and costs.backward_weight(1, 2) == 1.0 and costs.weight_held(1, 2) == 20


def test_measured_parts():
    from planner.profile.splitgrad import measure_backward_parts
    from planner.profile.timing import UnitCall

    class Unit(nn.Module):  # as a profiled unit: its outputs as a tuple
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(16, 16)

        def forward(self, x):
            return (torch.tanh(self.layer(x)),)

    torch.manual_seed(0)
    first, middle = Unit(), Unit()
    x = torch.randn(8, 16)
    h = torch.randn(8, 16, requires_grad=True)
    parts = measure_backward_parts([UnitCall(first, [x], [0], False), UnitCall(middle, [h], [0], False)],
                                   None, None, torch.device("cpu"), repeats=2)
    assert all(p.weight_s > 0 and p.held_bytes > 0 for p in parts)
    assert parts[1].input_s > 0
    # the middle unit keeps what its weight gradient reads (its input and the gradient at its matmul),
    # at least the input's 512 bytes
    assert parts[1].held_bytes >= 8 * 16 * 4


@pytest.mark.filterwarnings("ignore:grad and param do not obey")  # the timed whole backward into the leaf h
def test_held_bytes_are_measured_with_the_gradient_laid_out_as_the_model_lays_it_out():
    # a Linear on a time-major input runs as a matmul and a bias addition: its weight part keeps the bias's
    # gradient as it arrives and the matmul's contiguous copy of it, two storages where the gradient lies
    # time-major (a batch-first LSTM's backward hands it back so), one where it lies as the output does
    import json

    from planner.profile.profile import Profile
    from planner.profile.splitgrad import measure_backward_parts
    from planner.profile.timing import UnitCall
    from tests.support.runs import profile_of

    class Unit(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, h):
            return (torch.tanh(self.layer(h)),)

    h = torch.randn(5, 2, 8).transpose(0, 1).requires_grad_()  # (2, 5, 8), lying time-major
    unit = Unit()
    as_output, time_major = measure_backward_parts(
        [UnitCall(unit, [h], [0], False), UnitCall(unit, [h], [0], False, grad_orders={0: [1, 0, 2]})],
        None, None, torch.device("cpu"), repeats=1)
    assert (as_output.kept_bytes, time_major.kept_bytes) == (320, 640)
    assert time_major.held_bytes - as_output.held_bytes == 320
    # the profile finds the order from the model's backward, and its cut value keeps it
    profile = profile_of("tests.models:time_major_grads", sizes=(2,))
    assert [v.grad_order for v in profile.cut(2).values] == [{2: [1, 0, 2]}]
    assert [v.grad_order for v in profile.cut(1).values] == [{2: [0, 1, 2]}]  # contiguous, the value time-major
    assert profile.units[1].weight_kept_bytes == {2: 640}
    again = Profile.from_json(json.loads(json.dumps(profile.to_json())))
    assert again.cut(2).values[0].grad_order == {2: [1, 0, 2]}
    assert again.cut(2).values[0].at(2)["grad_order"] == [1, 0, 2]


def test_the_first_stage_and_a_later_stage_are_costed_as_they_run():
    """planner.cost.ranges: a stage from unit 0 runs no autograd in its input part and its whole
    backward in its weight part, holding everything saved between them; a later stage pays its
    units' parts and the split's own costs. The solvers' matrices say the same for every range."""
    import numpy as np

    from tests.support.synthetic import synthetic_profile

    L = 4
    profile = synthetic_profile(forward=[1.0] * L, backward=[2.0, 3.0, 4.0, 5.0], params=[8] * L,
                                saved=[100, 60, 50, 40], cut_act=[8] * (L - 1), sizes=(1,),
                                stage_overhead={1: (0.25, 0.5)})
    profile.engine_overhead_s = (0.0, 0.125)
    for l, unit in enumerate(profile.units):
        unit.backward_input_s, unit.backward_weight_s, unit.weight_held_bytes = {1: 1.5 + l}, {1: 1.0}, {1: 10 + l}
    profile.split_overhead_s = {1: (0.0625, 0.75, 0.375)}
    costs = range_costs(profile, 1)
    assert costs.backward_input(0, 2) == 0.0625 + 0.125  # the first stage: only the engine's own work
    assert costs.backward_weight(0, 2) == 0.5 + 2.0 + 3.0  # its whole backward, one call
    assert costs.weight_held(0, 2) == costs.saved(0, 2) + 8 == 168  # and the gradient received at cut 2
    assert costs.backward_input(1, 3) == 0.75 + 0.125 + 2.5 + 3.5
    assert costs.backward_weight(1, 3) == 0.375 + 2.0 and costs.weight_held(1, 3) == 11 + 12
    # a recomputed unit's forward: once in the first stage (in its weight part), in both parts later
    assert costs.backward_input(0, 2, recompute=[1]) == costs.backward_input(0, 2)
    assert costs.backward_weight(0, 2, recompute=[1]) == costs.backward_weight(0, 2) + 1.0
    assert costs.backward_input(1, 3, recompute=[1]) == costs.backward_input(1, 3) + 1.0
    for again in (0.0, costs.F):
        redo = list(range(L)) if again is costs.F else []
        matrices = costs.split_matrices(again)
        for a in range(L + 1):
            for e in range(L + 1):
                want = (costs.backward_input(a, e, recompute=redo), costs.backward_weight(a, e, recompute=redo)) \
                    if a < e else (np.inf, np.inf)
                assert (matrices[0][a, e], matrices[1][a, e]) == pytest.approx(want)
    # an older profile (no split_overhead_s): a later stage's input part pays the call, as before
    older = copy.deepcopy(profile)  # (range_costs keeps one per profile object)
    older.split_overhead_s = {}
    older = range_costs(older, 1)
    assert older.backward_input(1, 3) == 0.5 + 0.125 + 2.5 + 3.5 and older.backward_weight(1, 3) == 2.0
    assert older.backward_input(0, 2) == 0.125


def test_a_first_stage_with_frozen_weights_splits_into_one_whole_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    x, grad = torch.randn(3, 4), torch.randn(3, 2)
    pending = backward_input([model(x)], [grad], [x], [p for p in model.parameters() if p.requires_grad])
    assert len(pending.groups) == 1 and len(pending.groups[0].params) == 3  # the frozen weight is not passed
    assert all(p.grad is None for p in model.parameters())
    backward_weight(pending)
    reference(x).backward(grad)
    assert model[0].weight.grad is None
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


def test_what_neighbours_both_save_is_counted_once_in_a_stage():
    """planner.cost.ranges: d_k, the bytes units k - 1 and k both save, once in a stage holding both,
    not when either is recomputed; the solvers' prefix form and matrix say the same as `saved`."""
    import numpy as np

    from tests.support.synthetic import share_saved, synthetic_profile

    profile = synthetic_profile(forward=[1.0] * 4, backward=[2.0] * 4, params=[8] * 4, saved=[100, 60, 50, 40],
                                cut_act=[30, 20, 10], sizes=(1,))
    share_saved(profile, [1, 3])  # units 0, 1 share 30 bytes; units 2, 3 share 10
    costs = range_costs(profile, 1)
    assert list(costs.dup) == [0, 30, 0, 10]
    assert costs.saved(0, 4) == 250 - 30 - 10 and costs.saved(1, 4) == 150 - 10 and costs.saved(0, 1) == 100
    assert costs.saved(0, 2, recompute=[1]) == 100 + 30 - 30  # unit 1 keeps its input, which unit 0 saved too
    assert costs.saved(0, 2, recompute=[0]) == 0 + 60  # unit 0 keeps its input (none here), not its output
    assert costs.saved(0, 4, recompute=range(4)) == float(costs.inputs.sum())
    for every in (False, True):
        matrix = costs.saved_matrix(every)
        for a in range(4):
            for e in range(a + 1, 5):
                assert matrix[a, e] == pytest.approx(costs.saved(a, e, recompute=range(4) if every else ()))
        assert np.isinf(matrix[2, 2])


def test_a_model_whose_whole_backward_fails_is_profiled_with_each_gradient_laid_out_as_its_value(monkeypatch):
    """The gradients' layouts come from one more forward and backward of the whole model; where that fails (out
    of memory, a value written in place after it crossed) the profile says so in one line and goes on."""
    import planner.profile.measure as measure

    said = []
    real = measure.run_all_nodes

    def failing(captured, inputs, grad=False, **kwargs):
        if grad:
            raise RuntimeError("CUDA out of memory (as if)")
        return real(captured, inputs, grad=grad, **kwargs)

    monkeypatch.setattr(measure, "run_all_nodes", failing)
    profile = measure.profile_model("tests.models:time_major_grads", {}, [2], repeats=1, progress=said.append)
    assert all(not v.grad_order for c in profile.cuts for v in c.values)
    assert any("gradient layouts not found (RuntimeError: CUDA out of memory (as if))" in line for line in said)
