"""What a symbolically traced graph would compute differently from the model: custom autograd
Functions, module hooks, autograd and autocast regions, tensor hooks, state a module writes in place
(a BatchNorm called twice, an embedding's max_norm, a weight clipped through `.data`), and a forward
that reads the buffers it updates (spectral_norm) under recomputation. Each one is kept, or the
capture refuses it in one line; the models that keep it train like one process."""
import pytest
import torch
from torch import nn

from planner.errors import CaptureError
from planner.model.capture import capture
from planner.model.whole_function import kept_whole
from planner.model.entry import build_spec
from runtime.stage import BuffersAsInForward
from tests.support.runs import (assert_trains_like_one_process, max_abs_diff, plan_with, profile_of, reference_state,
                                reshape_plan)
from tests.support.staged import run_in_process

DROPS = "tests.capture_models:what_fx_drops"


def test_fx_keeps_functions_and_hooked_modules_whole_and_joins_writers_of_state():
    captured = capture(build_spec(DROPS, {}, 0).module)
    assert captured.method == "fx"
    # the custom Function is one call (its backward runs); the hooked block is one module call
    targets = {n.op: [] for n in captured.gm.graph.nodes}
    for n in captured.gm.graph.nodes:
        targets[n.op].append(getattr(n.target, "__name__", str(n.target)))
    assert "Reversal_apply" in targets["call_function"] and "hooked" in targets["call_module"]
    assert "hooked.a" not in targets["call_module"] and "scripted" in targets["call_module"]
    # BatchNorm called twice: its calls' units are one; `clip.weight.data.clamp_` joins clip's unit
    assert captured.unit_names == ["emb", "norm", "hooked", "out"]
    assert [(m.kept, m.absorbed) for m in captured.merges] == [("norm", ["first", "norm#2"]),
                                                               ("hooked", ["scripted", "last", "clip"])]
    assert "module 'norm' (BatchNorm1d) writes its state" in captured.merges[0].writes[0]
    assert "writes into parameter 'clip.weight'" in captured.merges[1].writes[0]
    # an embedding renormalised in place (max_norm) whose weight the output reads: every unit between
    tied = capture(build_spec(DROPS, {"tied": True}, 0).module)
    assert tied.unit_names == ["emb"]


def test_state_under_two_names_is_one_unit_with_its_readers():
    # bn2's statistics are bn1's tensors and tail.weight is clip.weight: known by name only, the
    # units were not joined, each stage updated or clipped its own copy (1.3e-2 from one process)
    entry = "tests.capture_models:aliased_state"
    captured = capture(build_spec(entry, {}, 0).module)
    assert captured.unit_names == ["f1", "bn1", "sep"]
    assert [(m.kept, m.absorbed) for m in captured.merges] == [
        ("bn1", ["mid", "f2", "bn2"]), ("sep", ["clip", "gap", "tail"])]
    assert "module 'bn2' (BatchNorm1d) writes its state" in " ".join(captured.merges[0].writes)
    assert "writes into parameter 'clip.weight'" in captured.merges[1].writes[0]
    profile = profile_of(entry, {}, sizes=(2,))
    reference = None
    for cuts in ([1], [2], [1, 2]):
        plan = plan_with(profile, cuts, 2, 8, "gpipe")
        reference = reference or reference_state(plan, steps=2)
        assert max_abs_diff(run_in_process(plan, steps=2), reference) <= 1e-5, cuts


def test_modes_inside_forward_go_to_torch_export():
    captured = capture(build_spec(DROPS, {"region": True}, 0).module)
    assert captured.method == "export" and "autograd or autocast mode" in captured.fallback_reason
    # the grad-mode region sits in the unit of the module it calls ('first'); the autocast region
    # starts with a free operation (h * scale), so it joins the unit before it with clip's call
    assert captured.unit_names == ["emb", "norm", "first", "last", "out"]


class _TensorHook(nn.Module):
    def __init__(self, shape_branch: bool):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.shape_branch = shape_branch

    def forward(self, x):
        if self.shape_branch and x.shape[-1] % 2 == 0:  # fx cannot trace a branch on a shape
            x = x * 1.0
        h = self.a(x)
        h.register_hook(lambda g: g * 3.0)
        return self.b(h)


class _HookedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.block.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.5,))

    def forward(self, x):
        if x.shape[-1] % 2 == 0:
            x = x * 1.0
        return self.block(x)


class _Carried(nn.Module):
    """State kept from one forward to the next in a plain attribute (a buffer would be updated)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.prev = torch.zeros(4)

    def forward(self, x):
        h = self.a(x) + self.prev
        self.prev = h.detach().mean(0)
        return h


class _GradientPenalty(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.a(x)
        s = self.b(torch.tanh(h))
        (g,) = torch.autograd.grad(s.sum(), h, create_graph=True)
        return s + g.pow(2).sum(-1, keepdim=True)


@pytest.mark.parametrize("module,match", [
    (_GradientPenalty(), "^cannot capture _GradientPenalty: forward differentiates .torch.autograd.grad, a gradient "
                         "penalty.*outside the pipelined model$"),
    (_Carried(), "forward reads self.prev and sets it again .* register it as a buffer"),
    (_TensorHook(False), "registers a hook on a tensor"),  # fx refuses, export refuses
    (_TensorHook(True), "registers a hook on a tensor"),
    (_HookedBlock(), "a module's full backward hook .* is lost by an exported graph"),
])
def test_what_no_graph_keeps_is_refused_in_one_line(module, match):
    with pytest.raises(CaptureError, match=match):
        capture(module, example_inputs=(torch.randn(2, 4),))


FUNCTIONS = "tests.capture_models:custom_functions"


def test_a_custom_autograd_function_is_kept_whole_by_export():
    module, x = build_spec(FUNCTIONS, {}, 0).module, torch.randn(3, 4)
    captured = capture(module, example_inputs=(x,))
    assert captured.method == "export"
    assert kept_whole(captured.gm) == {"Reversal": 1, "StraightThroughSplit": 1}
    (out,) = torch.utils._pytree.tree_leaves(captured.gm(x))
    out.pow(2).sum().backward()
    graph_grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    module(x).pow(2).sum().backward()
    for mine, eager in zip(graph_grads, [p.grad for p in module.parameters()]):
        assert torch.equal(mine, eager)


def test_the_profile_says_which_functions_it_kept_whole(tmp_path):
    from tests.support.runs import run_here

    done = run_here(["planner.cli", "profile", FUNCTIONS, "--micro-batch-sizes", "2", "--repeats", "1", "--warmup", "0",
                     "--min-time", "0", "--link", "none", "--engine-cost", "none", "-o", str(tmp_path / "p.json")])
    assert done.returncode == 0, done.stderr
    assert "custom autograd Function StraightThroughSplit kept whole (1 call): its backward runs its forward " \
           "again" in done.stdout + done.stderr


@pytest.mark.parametrize("cuts,schedule,recompute", [([1], "1f1b", []), ([1, 2], "1f1b", []), ([1], "zb-h1", ["b"])])
def test_custom_functions_kept_whole_train_like_one_process(tmp_path, cuts, schedule, recompute):
    # recomputed (checkpointed) and with the backward split into its input and weight parts too
    import dataclasses

    profile = profile_of(FUNCTIONS, sizes=(2,))
    assert profile.capture == "export"
    plan = plan_with(profile, cuts, 2, 8, schedule)
    stages = [dataclasses.replace(stage, recompute=[u for u in stage.units if u in recompute]) for stage in plan.stages]
    plan = dataclasses.replace(plan, stages=stages)
    assert_trains_like_one_process(plan, tmp_path, FUNCTIONS, steps=2)


def test_custom_functions_kept_whole_train_like_one_process_under_bf16_mixed(tmp_path):
    # the kept Function runs under autocast on its inputs as they come (not a custom operator's cast rule)
    import dataclasses

    from tests.support.runs import execute, max_abs_diff, reference_state

    plan = dataclasses.replace(plan_with(profile_of(FUNCTIONS, sizes=(2,)), [1], 2, 4), precision="bf16-mixed")
    state = execute(plan, tmp_path, steps=2, lr=1.0)
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=1.0, training={"precision": "bf16-mixed"})) <= 1e-5


class _MatmulInside(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors  # under autocast: x and grad bf16, w fp32
        grad = grad.float()
        return 2.0 * grad @ w.t(), x.t().float() @ grad


def test_a_kept_function_runs_again_in_backward_under_its_forwards_autocast():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.w = nn.Linear(4, 4), nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            if x.shape[-1] % 2 == 0:
                x = x * 1.0
            return _MatmulInside.apply(self.a(x), self.w)

    torch.manual_seed(0)
    module, x = Model(), torch.randn(3, 4)
    captured = capture(module, example_inputs=(x,))
    grads = []
    for run in (lambda: torch.utils._pytree.tree_leaves(captured.gm(x))[0], lambda: module(x)):
        module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run()
        out.float().pow(2).sum().backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_two_functions_of_one_name_are_two_calls():
    # a factory makes classes of one qualified name: each graph runs its own (not the first one captured)
    def scaler(k):
        class Scaler(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * k

            @staticmethod
            def backward(ctx, grad):
                return grad * k
        return Scaler

    x = torch.randn(3, 4)
    for k in (2.0, 5.0):
        module = _Calls(scaler(k))
        (out,) = torch.utils._pytree.tree_leaves(capture(module, example_inputs=(x,)).gm(x))
        assert torch.equal(out, module(x))


class _OnExport(nn.Module):
    """A linear layer after a branch on a shape, which fx cannot trace: torch.export captures it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def first(self, x):
        if x.shape[-1] % 2 == 0:
            x = x * 1.0
        return self.a(x)


class _HalfAndNothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, columns):
        ctx.columns = columns
        return x[:, columns] * 2.0, None

    @staticmethod
    def backward(ctx, grad, nothing):  # not autograd's: 5, not 2
        whole = grad.new_zeros(grad.shape[0], 4)
        whole[:, ctx.columns] = 5.0 * grad
        return whole, None


def test_a_kept_function_may_take_a_slice_and_return_none():
    class Model(_OnExport):
        def forward(self, x):
            half, nothing = _HalfAndNothing.apply(self.first(x), slice(0, 2))
            return half if nothing is None else -half

    module, x = Model(), torch.randn(3, 4)
    (out,) = torch.utils._pytree.tree_leaves(capture(module, example_inputs=(x,)).gm(x))
    out.pow(2).sum().backward()
    graph_grad = module.a.weight.grad.clone()
    module.zero_grad()
    module(x).pow(2).sum().backward()
    assert torch.equal(graph_grad, module.a.weight.grad)


class _PassesASize(nn.Module):
    def forward(self, x):
        from tests.capture_models import Reversal
        if x.shape[-1] % 2 == 0:
            x = x * 1.0
        return Reversal.apply(x, x.shape[0])


def test_a_custom_function_given_a_size_is_refused():
    with pytest.raises(CaptureError, match="passes a size of a tensor to the custom autograd Function Reversal"):
        capture(_PassesASize(), example_inputs=(torch.randn(3, 4),))


class _Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + 0.1 * torch.rand_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Doubles(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2.0)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


class _Calls(_OnExport):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function.apply(self.first(x) * 1.0)


@pytest.mark.parametrize("function,match", [(_Noisy, "_Noisy draws random numbers, so the second forward"),
                                            (_Doubles, "_Doubles writes into its inputs")])
def test_a_custom_function_kept_whole_refuses_what_its_second_forward_would_change(function, match):
    # found where the graph first runs (the profile's first batch names the operation: planner.autograd_function)
    captured, x = capture(_Calls(function), example_inputs=(torch.randn(2, 4),)), torch.randn(2, 4)
    with pytest.raises(CaptureError, match=match):
        captured.gm(x)


def test_recomputation_sees_the_buffers_its_forward_read():
    """spectral_norm's forward reads and updates its vectors: a recomputation on the updated ones
    would give other gradients (BuffersAsInForward)."""
    from torch.utils.checkpoint import checkpoint

    def layer():
        torch.manual_seed(0)
        return torch.nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))

    plain, recomputed, x = layer(), layer(), torch.randn(3, 4)
    plain(x).sum().backward()
    checkpoint(recomputed, x, use_reentrant=False, context_fn=BuffersAsInForward(recomputed).contexts).sum().backward()
    weight = lambda m: m.parametrizations.weight.original  # noqa: E731
    assert torch.equal(weight(recomputed).grad, weight(plain).grad)
    for key, value in plain.state_dict().items():  # the vectors updated once, as without recomputation
        assert torch.equal(recomputed.state_dict()[key], value), key


def test_models_fx_would_miscompute_train_like_one_process(tmp_path):
    # the reversal's output crosses cut 2, the hooked block starts the last stage
    profile = profile_of(DROPS, sizes=(2,))
    assert_trains_like_one_process(plan_with(profile, [2], 2, 8), tmp_path / "fx", DROPS, steps=2)
    # the autograd and autocast regions, captured by torch.export
    regions = profile_of(DROPS, {"region": True}, sizes=(2,))
    assert_trains_like_one_process(plan_with(regions, [2, 3], 2, 8), tmp_path / "export", DROPS, {"region": True},
                                   steps=2)


def test_spectral_norm_recomputed_trains_like_one_process(tmp_path):
    profile = profile_of("tests.capture_models:spectral_chain", sizes=(2,))
    plan = plan_with(profile, [2], 2, 8)
    plan = reshape_plan(plan, recompute={g: list(stage.units) for g, stage in enumerate(plan.stages)})
    assert_trains_like_one_process(plan, tmp_path, "tests.capture_models:spectral_chain", steps=2)


def test_arguments_the_batches_leave_none_are_traced_as_none():
    from planner.model.capture import run_all_nodes

    spec = build_spec("tests.capture_models:optional_arguments", {}, 0)
    captured = capture(spec.module)
    assert captured.method == "fx" and captured.traced_as_none == {"bias"}
    inputs, _ = spec.batch(3, 1)
    values = run_all_nodes(captured, inputs)
    assert torch.equal(values[next(reversed(values))], spec.module(inputs[0], **inputs[1]))
    # a batch giving what the graph took as None: it would be ignored
    later = build_spec("tests.capture_models:optional_arguments", {"bias_from": 2}, 0)
    captured = capture(later.module)
    with pytest.raises(CaptureError, match="argument 'bias' None .* batch\\(\\) must give the same arguments"):
        captured.input_values(later.batch(3, 2)[0])


def test_arguments_traced_as_none_keep_their_places_beside_varargs():
    class Varargs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x, bias=None, *rest, scale=None, **extra):
            h = self.a(x)
            return h if scale is None else h * scale

    module, x, scale = Varargs(), torch.randn(2, 4), torch.full((2, 4), 3.0)
    captured = capture(module, example_inputs=(x, None, {"scale": scale}))
    assert captured.traced_as_none == {"bias"}
    from planner.model.capture import run_all_nodes
    values = run_all_nodes(captured, (x, None, {"scale": scale}))
    assert torch.equal(values[next(reversed(values))], module(x, scale=scale))


def test_a_buffer_reassigned_in_forward_goes_to_torch_export_and_the_model_stays_whole():
    """`self.count = self.count + 1` left a traced proxy in the model (the next run read it)."""
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count = self.count + 1
            return self.a(x) * (1 + 0 * self.count)

    module = Counting()
    captured = capture(module, example_inputs=(torch.randn(2, 4),))
    assert captured.method == "export" and "assigns to the module attribute 'count'" in captured.fallback_reason
    assert isinstance(module.count, torch.Tensor) and module.count.item() == 0


STATE = "tests.capture_models:forward_state"


def test_what_forward_sets_on_the_model_is_recorded_and_a_loss_reading_it_refused():
    captured = capture(build_spec(STATE, {}, 0).module)
    assert captured.method == "export" and "assigns to the module attribute" in captured.fallback_reason
    assert captured.forward_sets == ["gate.aux", "last"]
    # the profile runs the loss on the graph's output with those attributes unreadable
    with pytest.raises(CaptureError, match="the loss function reads the model attribute 'gate.aux', which forward "
                                           "sets .* return the value from forward"):
        profile_of(STATE, {"loss_reads": True}, sizes=(2,))
    with pytest.raises(CaptureError, match="the loss function reads the model's parameter 'b.weight' besides the "
                                           "output .* add the term in forward"):
        profile_of(STATE, {"penalty": "b"}, sizes=(2,))
    profile_of(STATE, {"penalty": "c"}, sizes=(2,))  # the last unit's weight: the last stage holds it


def test_a_loss_reading_state_the_last_stage_does_not_hold_is_refused_by_both_profiles():
    from planner.profile.analytic import DeviceSpec
    from planner.profile.analytic_profile import analytic_profile

    # another stage's buffer or frozen weight: the last rank holds a storage-less copy (it stopped on a
    # meta tensor); a parameter penalty, on meta too
    device = DeviceSpec(name="test", peak_flops={"float32": 1e12}, memory_bandwidth=1e11, efficiency=0.5)
    refusals = {("constant", "b.scale"): "reads the model's buffer 'b.scale', which a layer before the last uses",
                ("constant", "b.bias"): "reads the model's frozen parameter 'b.bias', which a layer before the last",
                ("penalty", "b"): "reads the model's parameter 'b.weight' besides the output"}
    for (option, value), match in refusals.items():
        with pytest.raises(CaptureError, match=match):
            analytic_profile(STATE, {option: value}, [2], device)
    with pytest.raises(CaptureError, match=refusals[("constant", "b.scale")]):
        profile_of(STATE, {"constant": "b.scale"}, sizes=(2,))
    # the last unit's buffer is the last stage's; so is its weight
    analytic_profile(STATE, {"constant": "c.scale"}, [2], device)
    analytic_profile(STATE, {"penalty": "c"}, [2], device)


def test_the_guarded_loss_trips_on_any_use_and_puts_the_attributes_back():
    from planner.model.forward_state import guarded_loss

    root = nn.Sequential(nn.Linear(2, 2))
    root[0].kept = torch.ones(())
    uses = [lambda: 2.0 * root[0].kept, lambda: torch.add(torch.ones(()), root[0].kept), lambda: root[0].kept + 1,
            lambda: bool(root[0].kept), lambda: root[0].kept.mean(), lambda: -root[0].new]
    for use in uses:
        guarded = guarded_loss(lambda out, target: use(), root, ["0.kept", "0.new"])
        with pytest.raises(CaptureError, match="reads the model attribute '0.(kept|new)'"):
            guarded(None, None)
        assert torch.equal(root[0].kept, torch.ones(())) and not hasattr(root[0], "new")
    assert guarded_loss(len, root, []) is len  # nothing set in forward: the loss itself
    assert guarded_loss(lambda out, target: out + target, root, ["0.kept"])(1, 2) == 3


@pytest.mark.parametrize("args, cuts", [({}, [1]), ({"constant": "c.scale"}, [2])])
def test_attributes_forward_sets_that_no_loss_reads_train_like_one_process(tmp_path, args, cuts):
    # and a loss reading the last unit's buffer: the last stage holds it
    profile = profile_of(STATE, args, sizes=(2,))
    assert_trains_like_one_process(plan_with(profile, cuts, 2, 8), tmp_path, STATE, args, steps=2)


def test_a_forward_taking_star_args_is_exported_and_trains_like_one_process(tmp_path):
    from planner.model.fx_trace import trace_fx

    entry = "tests.capture_models:star_args"
    trace_fx(build_spec(entry, {}, 0).module, set())  # fx alone would take it
    captured = capture(build_spec(entry, {}, 0).module)
    assert captured.method == "export" and "forward's *args takes the batch's values" in captured.fallback_reason
    assert_trains_like_one_process(plan_with(profile_of(entry, sizes=(2,)), [1], 2, 8), tmp_path, entry, steps=2)


class _LayerDrop(nn.Module):
    def __init__(self, draw):
        super().__init__()
        self.layers, self.draw = nn.ModuleList(nn.Linear(4, 4) for _ in range(4)), draw

    def forward(self, x):
        for layer in self.layers:
            if self.training and self.draw() < 0.5:  # the layers one trace takes would be trained forever
                continue
            x = x + torch.tanh(layer(x))
        return x


class _Warmup(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        return self.a(x) * min(1.0, self.calls / 4)


@pytest.mark.parametrize("module,match", [
    (_LayerDrop(lambda: __import__("random").random()), "forward draws random numbers in Python"),
    (_LayerDrop(lambda: float(torch.rand(()))), "forward draws from torch's random generator"),
    (_Warmup(), "forward changes the attribute 'calls' .0 before the trace, 1 after.*keep it in a buffer"),
])
def test_what_a_trace_would_fix_at_its_traced_value_is_refused(module, match):
    import random

    state = random.getstate()
    with pytest.raises(CaptureError, match=match):
        capture(module, example_inputs=(torch.randn(2, 4),))
    random.setstate(state)
    assert getattr(module, "calls", 0) == 0  # the model is left as it was


def test_a_tripwire_inside_a_list_and_a_loss_that_fails_on_its_own():
    from planner.model.forward_state import guarded_loss, state_read_by_loss

    root = nn.Sequential(nn.Linear(2, 2))
    stacked = guarded_loss(lambda out, target: torch.stack([out, root[0].kept]).sum(), root, ["0.kept"])
    with pytest.raises(CaptureError, match="reads the model attribute '0.kept'"):
        stacked(torch.ones(()), None)
    class WithProperty(nn.Linear):
        scale = property(lambda self: 2.0, lambda self, value: None)

    held = nn.Sequential(WithProperty(2, 2))
    assert guarded_loss(lambda out, target: out * held[0].scale, held, ["0.scale"])(1.0, None) == 2.0
    # a loss failing by itself is left to the profile's timed call, which names it in one line
    state_read_by_loss(lambda out, target: target["missing"], root, torch.ones(2), {}, [root[0]])


class _CountsThenBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        __import__("random").random()
        if self.a(x).sum() > 0:  # on the data: neither fx nor torch.export takes it
            return x
        return -x


def test_a_capture_that_fails_leaves_the_model_and_the_generators_as_they_were():
    import random

    module, state = _CountsThenBranches(), random.getstate()
    with pytest.raises(CaptureError):
        capture(module, example_inputs=(torch.randn(2, 4),))
    assert module.calls == 0 and random.getstate() == state


def test_a_loss_reading_another_units_buffer_through_a_property_is_refused_too():
    """.T, .data, .mT hand on the values (a review found them passed: the property's name is __get__,
    skipped as metadata like .shape); .shape and .dtype still pass."""
    from planner.model.forward_state import state_read_by_loss

    root = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    root[0].register_buffer("table", torch.ones(2, 2))
    units = [root[0], root[1]]
    for read in (lambda: root[0].table.T.sum(), lambda: root[0].table.data.sum(), lambda: root[0].table.mT.sum()):
        with pytest.raises(CaptureError, match="reads the model's buffer '0.table'"):
            state_read_by_loss(lambda out, target: (out * read()).sum(), root, torch.ones(2), None, units)
    state_read_by_loss(lambda out, target: out.sum() * root[0].table.shape[0], root, torch.ones(2), None, units)


def test_what_a_loss_saves_of_a_complex_output_is_counted():
    from planner.profile.saved import loss_saved_bytes

    output = torch.randn(4, 8, dtype=torch.complex64)
    assert loss_saved_bytes(lambda out, target: (out.abs() ** 2).sum(), output, None) >= output.numel() * 8


class _Resets(nn.Module):
    """Sets its attributes afresh each forward (Funnel's pooling_mult): no state between steps."""

    def __init__(self):
        super().__init__()
        self.a, self.mult, self.scale = nn.Linear(4, 4), None, 1.0

    def forward(self, x):
        self.mult, self.scale = 1, 0.5
        for _ in range(2):
            x = self.a(x) * self.mult * self.scale
            self.mult *= 2
        return x


class _Switches(_Warmup):
    """Counts its calls and changes the graph on the fourth: two traces agree, later steps do not."""

    def forward(self, x):
        self.calls += 1
        return self.a(x) if self.calls < 4 else -self.a(x)


class _InitOnce(nn.Module):
    """A data-dependent initialisation on the first call (ActNorm): the flag is a fixed point, but
    the first trace's graph is not that of later steps."""

    def __init__(self):
        super().__init__()
        self.a, self.initialized = nn.Linear(4, 4), False

    def forward(self, x):
        if not self.initialized:
            self.initialized = True
            return self.a(x) * 2
        return self.a(x)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_an_attribute_set_afresh_each_forward_is_captured_and_left_as_it_was(method):
    module, x = _Resets(), torch.randn(2, 4)
    captured = capture(module, example_inputs=(x,), method=method)
    assert (module.mult, module.scale) == (None, 1.0)
    (out,) = torch.utils._pytree.tree_leaves(captured.gm(x))
    assert torch.allclose(out, module(x))


@pytest.mark.parametrize("module", [_Switches(), _InitOnce(), _Warmup()])
@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_counter_or_a_first_call_flag_is_refused_though_traced_again(module, method):
    attribute = "calls" if hasattr(module, "calls") else "initialized"
    with pytest.raises(CaptureError, match=f"forward changes the attribute '{attribute}'"):
        capture(module, example_inputs=(torch.randn(2, 4),), method=method)
    assert getattr(module, attribute) in (0, False)


class _CastsItsRouter(nn.Module):
    """Casts a layer to the dtype it has, in forward (Switch Transformers' and NLLB-MoE's routers)."""

    def __init__(self):
        super().__init__()
        self.router, self.out = nn.Linear(4, 2), nn.Linear(4, 4)

    def forward(self, x):
        self.router = self.router.to(torch.float32)
        return self.out(x) * torch.softmax(self.router(x), dim=-1).sum(-1, keepdim=True)


def test_a_layer_cast_to_its_own_dtype_in_forward_is_exported():
    # export swapped the layer's parameters for its own and failed ("Couldn't swap Linear.weight")
    module, x, to = _CastsItsRouter(), torch.randn(2, 4), nn.Module.to
    captured = capture(module, example_inputs=(x,), method="export")
    (out,) = torch.utils._pytree.tree_leaves(captured.gm(x))
    assert torch.allclose(out, module(x))
    assert nn.Module.to is to  # put back
    assert module.to(torch.float64).router.weight.dtype == torch.float64  # a real cast still casts


class _HostTensor(_OnExport):
    def forward(self, x):
        return self.first(x) * torch.ones(4)  # on the host whatever the model's device


def test_a_tensor_made_on_the_host_of_a_meta_model_is_named_as_the_cause():
    # an analytic profile captures on the meta device; the advice was to replace Python branches
    with torch.device("meta"):
        module = _HostTensor()
    with pytest.raises(CaptureError, match=r"Way out: in that module, it makes a tensor on the host .* "
                                           r"make it on the input's device \(device=x.device\)$"):
        capture(module, example_inputs=(torch.randn(2, 4, device="meta"),))


class _Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=x.shape[1])[0]


def test_a_tensor_read_as_a_size_is_named_as_the_cause():
    # packed sequences take their lengths from a tensor: the advice was to replace Python branches
    with pytest.raises(CaptureError, match=r"torch.export failed in 'lstm'.* Way out: in that module, it uses a "
                                           r"tensor's values as a size or a count .* pad to a fixed length"):
        capture(_Packed(), example_inputs=(torch.randn(2, 5, 4), torch.tensor([5, 3])))


def test_a_graph_computing_otherwise_than_forward_is_refused_and_the_model_left_as_it_was():
    from planner.model.same_output import check_same_output
    from planner.model.spec import call_model
    from planner.model.capture import run_all_nodes

    module, x = build_spec("tests.capture_models:exports_otherwise", {}, 0).module, torch.randn(3, 4)
    captured = capture(module, example_inputs=(x,))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CaptureError, match="does not compute what the model's forward does on the example batch: "
                                           "its output differs from forward's by"):
        check_same_output(module, captured.gm, lambda: call_model(module, (x,)),
                          lambda: captured.output_of(run_all_nodes(captured, (x,))))
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # running statistics too
    # every profile the suite makes runs the check: no graph computing as forward does is refused


def test_outputs_are_lined_up_by_their_place_not_their_count():
    # fx returns a ModelOutput as a plain dict; one with fewer fields than forward's was not compared
    from planner.model.same_output import check_same_output

    module, x = nn.Linear(4, 4), torch.randn(3, 4)
    hidden = module(x).detach()
    eager = lambda: {"hidden_states": (x, hidden), "logits": hidden, "loss": hidden.sum()}  # noqa: E731
    check_same_output(module, module, eager, lambda: {"logits": hidden + 1e-7})
    with pytest.raises(CaptureError, match=r"its output\['logits'\] differs from forward's by 1 "):
        check_same_output(module, module, eager, lambda: {"logits": hidden + 1.0})
    with pytest.raises(CaptureError, match=r"its output 1 has shape \(3,\), forward's \(3, 4\)"):
        check_same_output(module, module, lambda: {"a": x, "b": hidden}, lambda: (x, hidden[:, 0]))  # by position


def test_the_profile_refuses_a_graph_computing_otherwise_in_one_line(tmp_path):
    from tests.support.runs import run_here

    done = run_here(["planner.cli", "profile", "tests.capture_models:exports_otherwise", "--micro-batch-sizes", "2",
                     "--repeats", "1", "--warmup", "0", "--min-time", "0", "--link", "none", "--engine-cost", "none",
                     "-o", str(tmp_path / "p.json")])
    assert done.returncode != 0 and not (tmp_path / "p.json").exists()
    assert done.stderr.count("\n") == 1 and "differs from forward's by" in done.stderr, done.stderr


def test_a_loss_no_backward_can_start_from_is_refused_for_its_cause():
    """A vector, a Python number or a value that needs no gradient: refused by both profiles in one line
    saying so (the last unit's backward failed with advice about in-place operations, or passed)."""
    from planner.profile.analytic import DeviceSpec
    from planner.profile.analytic_profile import analytic_profile

    device = DeviceSpec(name="test", peak_flops={"float32": 1e12}, memory_bandwidth=1e11, efficiency=0.5)
    refusals = {"vector": r"returned a tensor of shape \(2,\), not one number; fix: .*reduction='mean'",
                "number": "returned a float, not a tensor; fix: return the loss tensor itself",
                "no_grad": "returned a value that needs no gradient, so no parameter would train"}
    for kind, match in refusals.items():
        with pytest.raises(CaptureError, match=match):
            profile_of("tests.capture_models:bad_loss", {"kind": kind}, sizes=(2,))
        if kind != "number":  # a meta tensor has no number: the analytic profile's loss raises (named at its unit)
            with pytest.raises(CaptureError, match=match):
                analytic_profile("tests.capture_models:bad_loss", {"kind": kind}, [2], device)
    profile_of("tests.capture_models:bad_loss", {"kind": "mean"}, sizes=(2,))


def test_units_passing_on_a_view_of_their_parameter_are_found():
    """A latent array expanded to the batch and read by the next unit: found on both captures, on the run's
    own values (a copy made by `.contiguous()` is not a view where the batch is larger than one)."""
    from planner.model.capture import capture, run_all_nodes
    from planner.model.entry import build_spec
    from planner.model.parameter_views import units_passing_parameter_views

    for args, b, found in (({}, 2, ["inp"]), ({"copy": True}, 2, []), ({"copy": True}, 1, ["inp"])):
        spec = build_spec("tests.capture_models:latents", args, 0)
        inputs, _ = spec.batch(b, 0)
        for method in ("fx", "export"):
            captured = capture(spec.module, inputs, method)
            views = units_passing_parameter_views(captured, run_all_nodes(captured, tuple(inputs), grad=True))
            assert [captured.units[k].name for k in views] == found, (args, b, method)
    spec = build_spec("builtin:gpt", {"layers": 2}, 0)
    captured = capture(spec.module, spec.batch(2, 0)[0])
    assert not units_passing_parameter_views(captured, run_all_nodes(captured, tuple(spec.batch(2, 0)[0])))
