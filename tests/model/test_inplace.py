"""In-place operations at unit boundaries: capture keeps every write in the unit of the tensor it
writes into, and models full of in-place activations and residual adds train exactly like one
process (parameters and buffers) at every cut position, on every schedule."""
import itertools

import pytest
import torch

from planner.model.capture import capture, run_all_nodes
from planner.cli.main import main as planner_main
from planner.model.inplace import augmented_assign
from planner.profile.timing import UnitCall, measure_units
from planner.model.entry import build_spec
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, reshape_plan
from tests.support.staged import run_in_process

WRITERS = "tests.capture_models:writers"
QUICK_PROFILE = ["--repeats", "1", "--min-time", "0", "--warmup", "0", "--link", "none", "--engine-cost", "none", "--quiet"]
RESNET = ("builtin:resnet", {"inplace": True, "batchnorm": True})
MOBILENET = ("builtin:mobilenet", {"blocks": 3, "image": 16})


def _captured(entry, args=None):
    return capture(build_spec(entry, args or {}, 0).module)


def test_writes_stay_in_the_unit_of_the_tensor_they_write_into():
    captured = _captured(WRITERS)
    assert captured.method == "fx"
    assert captured.unit_names == ["inp", "norm", "a", "c", "d", "out"]
    assert [(m.kept, m.absorbed) for m in captured.merges] == [("norm", ["act"]), ("a", ["b"]), ("d", ["drop"])]
    assert "nn.SiLU(inplace=True) in unit 'act' writes into a tensor made in unit 'norm'" in captured.merges[0].writes
    # `w += s` stays in place, as eager PyTorch runs it (fx alone would record `w = w + s`)
    assert any(n.target is augmented_assign for n in captured.gm.graph.nodes)
    # torchvision-style ResNet: the stem's nn.ReLU(inplace=True), a unit of its own, joins the stem conv
    resnet = _captured(*RESNET)
    assert resnet.unit_names[:2] == ["stem", "layers.0"] and resnet.merges[0].absorbed == ["stem_act"]


def test_model_inputs_and_buffers_written_in_place():
    # fx: `y.mul_(0.5)` in unit c, and the model reads y again in unit out: c..out are one unit
    assert [(m.kept, m.absorbed) for m in _captured(WRITERS, {"input_write": True}).merges][-1] == \
        ("c", ["d", "drop", "out"])
    # a buffer written in unit a and read in unit c: each stage would hold its own copy
    assert _captured("tests.capture_models:counter").unit_names == ["a"]


def test_profiling_puts_back_a_model_input_a_unit_writes():
    """A unit writing into a model input (y.mul_(0.5)) is timed many times: each call sees the same y."""
    spec = build_spec(WRITERS, {"input_write": True}, 0)
    captured = capture(spec.module)
    stage, io = captured.stage_module(3, 4)  # unit 'c' (with d, drop, out): writes y, then reads it
    inputs, target = spec.batch(2, 0)
    values = run_all_nodes(captured, inputs)
    args = [values[name].detach().clone().requires_grad_(name in io.received) for name in io.inputs + io.received]
    y = args[io.inputs.index("y")]
    before = y.clone()
    measure_units([UnitCall(stage, args, [], True)], spec.loss, target, torch.device("cpu"), repeats=3)
    assert torch.equal(y, before)


def _every_cut_plans(profile, three_stage="all"):
    """Every 2-stage and every 3-stage split ("all"), or ("adjacent", the larger models) the 3-stage splits
    [k, k + 1]: each cut position as a first and as a second cut, each unit alone in a middle stage."""
    L = len(profile.units)
    if three_stage == "all":
        return [[k] for k in range(1, L)] + [list(c) for c in itertools.combinations(range(1, L), 2)]
    return [[k, k + 1] for k in range(1, L - 1)]


@pytest.mark.parametrize("entry,args,three_stage", [
    (WRITERS, {}, "all"),
    (WRITERS, {"export": True}, "adjacent"),  # torch.export: ATen in-place operators
    (WRITERS, {"input_write": True}, "all"),
    (*RESNET, "all"),
    (*MOBILENET, "adjacent"),
    ("builtin:unet", {}, "adjacent"),
], ids=["writers", "writers-export", "writers-input", "resnet-inplace-bn", "mobilenet", "unet"])
def test_every_cut_position_trains_like_one_process(entry, args, three_stage):
    """Splits covering every cut position (`_every_cut_plans`), each stage built and run as a rank builds
    and runs it (tests/staged.py), against one process: parameters and buffers."""
    profile = profile_of(entry, args, sizes=(2,))
    reference = None
    for cuts in _every_cut_plans(profile, three_stage):
        plan = plan_with(profile, cuts, 2, 8, "gpipe")
        reference = reference or reference_state(plan, steps=2)
        assert max_abs_diff(run_in_process(plan, steps=2), reference) <= 1e-5, cuts


@pytest.mark.parametrize("schedule,entry,args,cuts,virtual", [
    ("1f1b", WRITERS, {"export": True}, [2, 4], 1),      # 3 stages: after BatchNorm + SiLU_; s crosses cut 4
    ("interleaved", *MOBILENET, [3, 12, 20], 2),         # 4 stages on 2 ranks, residual += at block ends
    ("bfs", *RESNET, [1, 3, 5], 2),
])
def test_schedules_with_in_place_writes(tmp_path, schedule, entry, args, cuts, virtual):
    """The real runtime (processes, transport) on the other schedules' orders; GPipe's order is
    the one every split above runs in."""
    plan = reshape_plan(plan_with(profile_of(entry, args, sizes=(2,)), cuts, 2, 8, "1f1b"), virtual_stages=virtual,
                        schedule=schedule)
    state = execute(plan, tmp_path, steps=2)
    assert max_abs_diff(state, reference_state(plan, steps=2)) <= 1e-5


def test_a_unit_that_cannot_run_alone_is_one_line(tmp_path, capsys):
    code = planner_main(["profile", "tests.capture_models:hidden_write", "--micro-batch-sizes", "2", *QUICK_PROFILE,
                         "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and not (tmp_path / "p.json").exists()
    assert "unit 'scale' (2 of 3)" in err and "operation 'scale_in_place' in module 'scale'" in err
    assert "in-place operation" in err and "fix:" in err


def test_a_model_that_fails_on_a_batch_names_the_operation(tmp_path, capsys):
    # BatchNorm1d cannot normalise one sample: the operation and its module, in one line
    code = planner_main(["profile", WRITERS, "--micro-batch-sizes", "1", *QUICK_PROFILE, "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "failed on a batch of 1: operation 'norm' in module 'norm' raised ValueError" in err
