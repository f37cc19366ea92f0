"""Lazy modules (nn.LazyLinear, nn.LazyBatchNorm1d) get their parameters where the model is built
(planner.model.entry.materialize_lazy): one forward of batch(2, 0) that leaves the buffers and the
random state as the model function left them, the same in every process, on meta too."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.model.entry import build_spec
from planner.model.spec import ModelEntryError, ModelSpec
from planner.model.meta import parameters_on_meta
from tests.models import LazyMLP, lazy_mlp
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state

ENTRY = "tests.models:lazy_mlp"


@pytest.mark.parametrize("norm", ["batch", "lazy"])
def test_a_built_model_has_its_parameters_and_its_buffers_as_made(norm):
    built = build_spec(ENTRY, {"norm": norm}, 3)
    after_build = torch.get_rng_state()
    torch.manual_seed(3)
    lazy_mlp(norm=norm)  # what the model function alone leaves
    assert torch.equal(after_build, torch.get_rng_state())  # rank 0's random stream starts here
    state = built.module.state_dict()
    assert state["a.weight"].shape == (8, 6) and state["c.weight"].shape == (8, 8)
    assert torch.equal(state["norm.running_mean"], torch.zeros(8))
    assert torch.equal(state["norm.running_var"], torch.ones(8))
    assert state["norm.num_batches_tracked"].item() == 0  # the forward moved no statistics
    again = build_spec(ENTRY, {"norm": norm}, 3).module.state_dict()
    assert max_abs_diff(state, again) == 0  # every process builds the same parameters


def test_parameters_on_meta_are_made_on_meta():
    # --init-state builds the model with its parameters on meta (runtime.initstate), the analytic
    # profile under torch.device("meta"): the lazy ones are made there too, with their shapes
    with parameters_on_meta():
        on_meta = build_spec(ENTRY, {"norm": "lazy"}, 0).module.state_dict()
    with torch.device("meta"):
        all_meta = build_spec(ENTRY, {"norm": "lazy"}, 0).module.state_dict()
    real = build_spec(ENTRY, {"norm": "lazy"}, 0).module.state_dict()
    assert {k: v.shape for k, v in on_meta.items()} == {k: v.shape for k, v in real.items()}
    assert all(on_meta[k].device.type == "meta" for k in ("a.weight", "c.bias", "norm.weight", "norm.running_mean"))
    assert all(v.device.type == "meta" for v in all_meta.values()) and all_meta["a.weight"].shape == (8, 6)


def test_an_analytic_profile_counts_the_lazy_parameters():
    from planner.profile.analytic import DeviceSpec
    from planner.profile.analytic_profile import analytic_profile

    device = DeviceSpec(name="test", peak_flops={"float32": 1e12}, memory_bandwidth=1e11, efficiency=0.5)
    profile = analytic_profile(ENTRY, {"norm": "lazy"}, [2], device)
    assert sum(u.param_bytes for u in profile.units) == 4 * (8 * 6 + 8 + 8 * 8 + 8 + 2 * 8 + 8 * 8 + 8)


def failing() -> ModelSpec:
    """A batch the lazy forward cannot take (2 features where `b` needs 8)."""
    module = nn.Sequential(nn.Linear(8, 8), nn.LazyLinear(4))
    return ModelSpec(module=module, batch=lambda n, step: ((torch.randn(n, 2),), torch.randn(n, 4)), loss=F.mse_loss)


def never_called() -> ModelSpec:
    module = LazyMLP(8, "none")
    module.spare = nn.LazyLinear(3)  # the forward never calls it
    return ModelSpec(module=module, batch=lambda n, step: ((torch.randn(n, 6),), torch.randn(n, 8)), loss=F.mse_loss)


def test_a_failing_lazy_forward_is_one_line():
    with pytest.raises(ModelEntryError) as e:
        build_spec("tests.model.test_lazy:failing", {}, 0)
    message = str(e.value)
    assert "\n" not in message and "lazy modules (1)" in message and "batch(2, 0)" in message
    assert "RuntimeError" in message and "nn.Linear for nn.LazyLinear" in message


def test_a_lazy_module_the_forward_never_calls_is_one_line():
    with pytest.raises(ModelEntryError, match=r"lazy module\(s\) spare got no parameters .* never calls them"):
        build_spec("tests.model.test_lazy:never_called", {}, 0)


def test_a_lazy_model_profiles_and_trains_like_one_process(tmp_path):
    profile = profile_of(ENTRY, {"norm": "batch"}, sizes=(2,))
    module = build_spec(ENTRY, {"norm": "batch"}, 0).module
    expected = sum(p.numel() * p.element_size() for p in module.parameters())
    assert sum(u.param_bytes for u in profile.units) == expected > 0  # not 0.00 MiB
    plan = plan_with(profile, [2], 2, 8)
    state = execute(plan, tmp_path, steps=2)
    assert max_abs_diff(state, reference_state(plan, steps=2)) <= 1e-5
    assert max_abs_diff(state, module.state_dict()) > 1e-4  # it trained


def test_a_lazy_model_starts_from_a_state_file(tmp_path):
    # --init-state: each rank builds the model with its parameters on meta, the lazy ones made there
    plan = plan_with(profile_of(ENTRY, {"norm": "batch"}, sizes=(2,)), [2], 2, 8)
    initial = build_spec(ENTRY, {"norm": "batch"}, 7).module.state_dict()  # not the plan's seed
    torch.save(initial, str(tmp_path / "init.pt"))
    state = execute(plan, tmp_path / "run", steps=2, extra=["--init-state", str(tmp_path / "init.pt")])
    assert max_abs_diff(state, reference_state(plan, steps=2, init_state=str(tmp_path / "init.pt"))) <= 1e-5
