"""Tensors cross a cut in the order their dimensions lie in memory (a channels-last activation stays
channels-last): the profile records the order, the plan carries it, messages travel in it and are
received as views with the sender's strides, and such runs train exactly as one process does."""
import json

import pytest
import torch

from planner.jsonio import JsonFileError
from planner.plan.file import load_plan, save_plan
from planner.profile.cut_profile import CutValue, dense_order
from planner.profile.reader import Reader
from runtime.comm import DescribedLayout, MessageLayout, PresenceLayout
from tests.support.runs import execute, fixed_plan, held_and_planned, max_abs_diff, plan_with, profile_of, reference_state

ENTRY = "tests.models:channels_last"  # units stem, blocks.0 .. blocks.2, head: channels-last between
CPU = torch.device("cpu")
LAST = [0, 2, 3, 1]


def _image(*shape):
    return torch.randn(*shape).to(memory_format=torch.channels_last)


def test_dense_order_names_a_layout_other_than_the_shapes():
    assert dense_order(_image(2, 3, 4, 5)) == LAST
    assert dense_order(torch.randn(2, 3, 4, 5)) is None  # the shape's own
    assert dense_order(torch.randn(3, 4).t()) == [1, 0]
    assert dense_order(torch.randn(4, 6)[:, :3]) is None  # not dense: it travels contiguous


def test_one_tensor_travels_in_its_order_and_arrives_with_its_strides():
    sent = _image(2, 3, 4, 5)
    layout = MessageLayout([(tuple(sent.shape), sent.dtype)], "test", [LAST])
    wire, copied = layout.pack([sent], CPU)
    assert not copied and wire.is_contiguous() and wire.shape == (2, 4, 5, 3)  # its own bytes, no copy
    buffer = layout.empty(CPU)
    assert buffer.is_contiguous() and buffer.shape == wire.shape  # what gloo and the rings fill
    buffer.copy_(wire)
    (received,) = layout.unpack(buffer)
    assert torch.equal(received, sent) and received.stride() == sent.stride()
    # a tensor laid out otherwise is copied into the planned order
    wire, copied = layout.pack([sent.contiguous()], CPU)
    assert copied and torch.equal(layout.unpack(wire)[0], sent)


def test_tensors_in_a_byte_buffer_keep_their_orders():
    sent = [_image(2, 3, 4, 5), torch.randn(2, 3), torch.randn(3, 2).t()]
    layout = MessageLayout([(tuple(t.shape), t.dtype) for t in sent], "test", [LAST, None, [1, 0]])
    wire, _ = layout.pack(sent, CPU)
    received = layout.unpack(wire)
    assert all(torch.equal(r, s) and r.stride() == s.stride() for r, s in zip(received, sent))
    framed = PresenceLayout(layout)  # a gradient message's first: flags, then the same layout
    grads, present = framed.unpack(framed.pack(sent, [True, False, True], CPU))
    assert present == (True, False, True) and grads[0].stride() == sent[0].stride()
    assert torch.equal(grads[2], sent[2])
    # under autocast the first message says its dtypes; the later ones keep the planned orders
    _, exact = DescribedLayout(layout).unpack(DescribedLayout(layout).pack(sent, CPU)[0])
    assert exact.orders == layout.orders


def test_a_complex_tensor_in_its_order():
    value = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    sent = torch.complex(value, -value).contiguous(memory_format=torch.channels_last)
    layout = MessageLayout([(tuple(sent.shape), sent.dtype)], "test", [LAST])
    wire, copied = layout.pack([sent], CPU)
    assert not copied and not wire.is_complex()
    (received,) = layout.unpack(wire)
    assert torch.equal(torch.view_as_real(received), torch.view_as_real(sent)) and received.stride() == sent.stride()


def test_the_profile_and_the_plan_carry_the_order():
    profile = profile_of(ENTRY, {"skip": True}, sizes=(2,))
    cuts = {c.before_unit: c.values for c in profile.cuts}
    assert [v.order for v in cuts[2]] == [{2: LAST}, {2: LAST}]  # the stem's output and block 0's
    assert cuts[4][0].order == {}  # the pooled features: contiguous
    plan = plan_with(profile, [2], 2, 8)
    assert [v.get("order") for v in plan.stages[0].send] == [LAST, LAST]


def test_a_cut_value_refuses_an_order_that_is_not_its_dimensions(tmp_path):
    value = CutValue(name="x", kind="tensor", dtype="float32", shape={2: [2, 3, 4, 5]}, bytes={2: 480},
                     order={2: LAST})
    read = Reader("profile.json", sizes=[2])
    assert CutValue.from_json(json.loads(json.dumps(value.to_json())), read, "cut").order == {2: LAST}
    for key in ("order", "grad_order"):  # the value's, and its gradient's (where the backward lays it out otherwise)
        for bad in ([0, 1, 2], [0, 2, 2, 1], "0231"):
            with pytest.raises(JsonFileError, match=f"cut.{key}"):
                CutValue.from_json(dict(value.to_json(), **{key: {"2": bad}}), read, "cut")
        plan = plan_with(profile_of(ENTRY, {}, sizes=(2,)), [2], 2, 8)
        plan.stages[0].send[0][key] = [0, 1, 2]
        path = str(tmp_path / "plan.json")
        save_plan(plan, path)
        with pytest.raises(JsonFileError, match=f"has {key} "):
            load_plan(path)
    # both ends of a cut must agree on it: the receiving stage's gradient order alone differs
    plan = plan_with(profile_of(ENTRY, {}, sizes=(2,)), [2], 2, 8)
    plan.stages[1].recv[0]["grad_order"] = [0, 3, 2, 1]
    save_plan(plan, path)
    with pytest.raises(JsonFileError, match="sends other values than stage 1 receives"):
        load_plan(path)


@pytest.mark.parametrize("args, cuts, schedule, p2p", [
    ({}, [2], "1f1b", "auto"),  # one channels-last tensor a message, through shared memory
    ({}, [2], "1f1b", "gloo"),  # ... or gloo
    ({"skip": True}, [1, 3], "gpipe", "auto"),  # two a message (a byte buffer), three stages
    ({"skip": True}, [2], "zb-h1", "auto"),  # the split backward's gradients in the same order
])
def test_channels_last_activations_train_like_one_process(tmp_path, args, cuts, schedule, p2p):
    plan = plan_with(profile_of(ENTRY, args, sizes=(2,)), cuts, 2, 8, schedule)
    assert all(v.get("order") == LAST for v in plan.stages[0].send)
    state = execute(plan, tmp_path, steps=2, extra=["--p2p", p2p])
    assert max_abs_diff(state, reference_state(plan, steps=2)) <= 1e-5


@pytest.mark.parametrize("args, cuts, schedule", [
    ({"skip": True}, [2], "1f1b"),
    ({}, [1, 2, 3], "zb-v"),  # the split backward's copies of views, two stages a rank
])
def test_channels_last_activations_train_like_one_process_on_torchs_engine(tmp_path, args, cuts, schedule):
    plan = fixed_plan(profile_of(ENTRY, args, sizes=(2,)), cuts, schedule, [],
                      virtual_stages=2 if schedule == "zb-v" else 1)
    state = execute(plan, tmp_path, steps=2, extra=["--engine", "torch"])
    assert max_abs_diff(state, reference_state(plan, steps=2)) <= 1e-5


def test_torchs_engine_sends_in_the_plans_order_and_its_stage_reads_the_senders_strides():
    """torch's stages allocate contiguous receive buffers from their metadata: that metadata is the
    message's shape in memory order, and the stage reads the buffer back as the sender's layout."""
    from runtime.stage import build_rank
    from runtime.torch_engine import StageAsTorchModule, _Batch, _meta

    plan = plan_with(profile_of(ENTRY, {}, sizes=(2,)), [2], 2, 8)
    first = build_rank(plan, plan.topology(), 0, CPU).stages[0]
    second = build_rank(plan, plan.topology(), 1, CPU).stages[0]
    (sent_meta,), (received_meta,) = _meta(first.send), _meta(second.recv)
    shape = first.send[0]["shape"]
    assert sent_meta.shape == received_meta.shape == torch.Size([shape[d] for d in LAST])
    batch = _Batch()
    batch.micro_batch_size = 2
    batch.inputs = [[torch.randn(2, 3, 8, 8)]]
    batch.targets = [torch.randint(0, 4, (2,))]
    seen = []
    stage = StageAsTorchModule(first, batch, CPU, lambda out, target: out.sum(), 1.0)
    (sent,) = stage(torch.zeros(2, dtype=torch.int64))
    assert sent.shape == sent_meta.shape and sent.is_contiguous()
    receiver = StageAsTorchModule(second, batch, CPU, lambda out, target: out.float().sum(), 1.0)
    receiver.stage_module.register_forward_pre_hook(lambda module, values: seen.extend(values))
    receiver(sent.detach().requires_grad_(), samples=torch.zeros(2, dtype=torch.int64))
    (value,) = [v for v in seen if isinstance(v, torch.Tensor) and v.dim() == 4]
    assert value.shape == torch.Size(shape) and value.is_contiguous(memory_format=torch.channels_last)


def test_a_rank_receives_and_sends_gradients_in_the_plans_order():
    from runtime.runner import StageRunner
    from runtime.stage import build_rank

    plan = plan_with(profile_of(ENTRY, {"skip": True}, sizes=(2,)), [2], 2, 8)
    first = StageRunner(build_rank(plan, plan.topology(), 0, CPU).stages[0])
    second = StageRunner(build_rank(plan, plan.topology(), 1, CPU).stages[0])
    assert first.act_out.orders == second.act_in.orders == [tuple(LAST)] * 2
    # their gradients in the order the model's backward lays them out (the profile's grad_order): NCHW here
    assert [v.get("grad_order") for v in second.stage.recv] == [[0, 1, 2, 3]] * 2
    assert first.grad_in.orders == second.grad_out.orders == [(0, 1, 2, 3)] * 2


@pytest.mark.parametrize("args, cuts, schedule, recompute", [
    ({"skip": True}, [1, 3], "1f1b", [2]),
    ({}, [2], "zb-h1", []),
    ({"skip": True}, [1, 2, 3], "zb-v", [2]),
])
def test_ranks_receiving_in_order_hold_what_the_plan_says(tmp_path, args, cuts, schedule, recompute):
    """A message in its order is received as a view of its buffer, sent without a copy where the value
    lies so already: the ranks' saved bytes are the plan's to the byte (and train as one process)."""
    for held, planned in held_and_planned(tmp_path, ENTRY, args, cuts, schedule, recompute):
        assert held == planned
