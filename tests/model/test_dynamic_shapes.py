"""Values whose shape the data sets (a mixture of experts' tokens per expert) never cross a cut:
capture joins the units from the one making such a value to the last one reading it, so a plan of
such a model runs (the runtime receives every crossing value into a buffer of the plan's shape)."""
import pytest
import torch

from planner.model import dynamic_shapes
from planner.model.capture import capture
from planner.model.entry import build_spec
from tests.support.runs import assert_trains_like_one_process, plan_with, profile_of

ROUTED = "tests.capture_models:routed"
UNITS = ["inp", "norm", "blocks.0.gate", "blocks.1.gate", "out"]


@pytest.mark.parametrize("export", [False, True])
def test_routed_tokens_stay_in_their_layers_unit(export):
    spec = build_spec(ROUTED, {"export": export}, 0)
    rng, count = torch.get_rng_state(), spec.module.norm.num_batches_tracked.clone()
    captured = capture(spec.module)
    assert captured.method == ("export" if export else "fx")
    # each layer's experts (units of their own before) join its router: x[sel] and the experts'
    # outputs on it have the data's shape; the layer's output (index_add into zeros_like(x)) has not
    assert captured.unit_names == UNITS
    assert [(m.kept, m.absorbed[0], m.absorbed[-1]) for m in captured.shape_merges] == [
        ("blocks.0.gate", "blocks.0.experts.0.0", "blocks.0.experts.2.2"),
        ("blocks.1.gate", "blocks.1.experts.0.0", "blocks.1.experts.2.2")]
    assert "has a shape the data sets (through " in captured.shape_merges[0].writes[0]
    assert "nonzero" in captured.shape_merges[0].writes[0]
    assert not captured.merges  # no in-place write joins anything here
    # one value of the input's shape crosses each cut
    for k in range(1, len(captured.units)):
        assert len(captured.crossing(k)) == 1
    # the fx graph's fake run left the model's state and the random stream as they were
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(spec.module.norm.num_batches_tracked, count)


def test_without_a_fake_run_everything_after_the_router_is_one_unit(monkeypatch):
    """Where the fake run fails, the operations that may make a data-told size and everything made
    from them count: more units joined than needed, never a cut the runtime cannot carry."""
    def fails(gm, inputs):
        raise RuntimeError("no fake kernel")

    monkeypatch.setattr(dynamic_shapes, "_fake_run", fails)
    captured = capture(build_spec(ROUTED, {}, 0).module)
    assert captured.unit_names == ["inp", "norm", "blocks.0.gate"]


def test_models_without_such_operations_skip_the_fake_run(monkeypatch):
    def never(gm, inputs):
        raise AssertionError("the fake run was not needed")

    monkeypatch.setattr(dynamic_shapes, "_fake_run", never)
    for entry, args in (("builtin:gpt", {"layers": 2}), ("tests.capture_models:writers", {})):
        captured = capture(build_spec(entry, args, 0).module)
        assert not captured.shape_merges


def test_slices_by_sizes_are_not_data_sized():
    class Halves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(4, 8)

        def forward(self, x):
            h = self.a(x)
            return self.b(h[:, : h.size(1) // 2]) + self.b(h[:, h.shape[1] - 4:])

    gm = torch.fx.symbolic_trace(Halves())
    assert dynamic_shapes._may_make_data_sizes(gm) == []


def test_a_routed_model_trains_like_one_process(tmp_path):
    profile = profile_of(ROUTED, sizes=(2,))
    assert [u.name for u in profile.units] == UNITS
    assert profile.extra["shape_merges"][0]["unit"] == "blocks.0.gate"
    # a cut between the two routed layers: the value crossing is the hidden state (the runtime
    # stopped with "a tensor of shape (0,) where the plan has (1,)" before, at any cut inside a layer)
    plan = plan_with(profile, [3], 2, 8)
    assert_trains_like_one_process(plan, tmp_path, ROUTED, steps=2)


def test_a_module_called_whole_is_looked_into():
    """A hooked module is one call in the graph (its hooks run): its data-sized output is still found."""
    class Positive(torch.nn.Module):
        def forward(self, x):
            return x[x[:, 0] > 0]

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.pick, self.b = torch.nn.Linear(4, 4), Positive(), torch.nn.Linear(4, 4)
            self.pick.register_forward_hook(lambda module, args, out: None)

        def forward(self, x):
            return self.b(self.pick(self.a(x))).sum(0)

    captured = capture(Net(), example_inputs=(torch.randn(6, 4),))
    assert captured.unit_names == ["a", "pick"]  # b reads pick's rows: one unit with it
    assert [(m.kept, m.absorbed) for m in captured.shape_merges] == [("pick", ["b"])]
