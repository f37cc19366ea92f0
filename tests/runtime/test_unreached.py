"""A weight whose output reaches no loss (used only through a comparison) keeps a None gradient, as
in single-process training, where an optimizer then skips it: no weight decay, no moments. The
gradient message across the cut carries zeros in its place (its size is the plan's) and its first
one between two ranks says which tensors have a gradient (runtime.comm.PresenceLayout)."""
import pytest
import torch

from planner.model.entry import build_spec
from runtime.comm import MessageLayout, PresenceLayout
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, reshape_plan

ADAMW = ["--optimizer", "adamw", "--weight-decay", "0.1"]  # decay moves a weight given a zero gradient
ENTRY = "tests.models:gated_branch"


def _trains_like_one_process(plan, tmp_path, args=None, extra=()):
    state = execute(plan, tmp_path, steps=2, lr=1e-3, extra=ADAMW + list(extra))
    reference = reference_state(plan, steps=2, lr=1e-3, optimizer="adamw", training=dict(weight_decay=0.1))
    assert max_abs_diff(state, reference) <= 1e-5
    initial = build_spec(ENTRY, args or {}, 0).module.state_dict()
    assert torch.equal(state["gate.weight"], initial["gate.weight"])  # no loss reaches it: untouched
    assert (state["inp.weight"] - initial["inp.weight"]).abs().max() > 1e-4


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_unreached_weight_across_a_cut(tmp_path, schedule):
    # units inp, gate | mid.0 ...: the gate's output crosses the cut and gets no gradient there
    profile = profile_of(ENTRY)
    assert [u.name for u in profile.units][:2] == ["inp", "gate"]
    _trains_like_one_process(plan_with(profile, [2], 1, 4, schedule), tmp_path)


@pytest.mark.parametrize("p2p", ["auto", "gloo"])  # the buckets summed through shared memory or by gloo
def test_unreached_weight_with_replicas(tmp_path, p2p):
    # two replicas, two stages per rank (interleaved): the data-parallel buckets hand every weight a
    # gradient in a bucket, and the unreached one's is dropped again after the all-reduce
    plan = reshape_plan(plan_with(profile_of(ENTRY), [1, 2, 4], 1, 4), virtual_stages=2, data_parallel=2,
                        schedule="interleaved")
    _trains_like_one_process(plan, tmp_path, extra=["--p2p", p2p])


def test_unreached_weight_between_stages_on_one_rank(tmp_path):
    # three stages on one rank hand their values over in memory, with no message to say it
    plan = reshape_plan(plan_with(profile_of(ENTRY), [2, 4], 1, 4), virtual_stages=3, schedule="interleaved")
    _trains_like_one_process(plan, tmp_path)


def test_unreached_weight_under_replicated_stages(tmp_path):
    # the last stage on two devices: two peers for stage 0's gradients, each pair's first message framed
    plan = reshape_plan(plan_with(profile_of(ENTRY), [2], 1, 4), replicas=[1, 2])
    _trains_like_one_process(plan, tmp_path)


def test_unreached_tie_across_ranks(tmp_path):
    # gate (stage 0) and gate2 (stage 1) share a weight no gradient reaches: the tie's all-reduce over
    # its holders leaves it None when no holder's backward reached it
    profile = profile_of(ENTRY, {"tied": True})
    assert profile.extra["shared_parameters"] and "gate2" in [u.name for u in profile.units[2:]]
    _trains_like_one_process(plan_with(profile, [2], 1, 4), tmp_path, {"tied": True})


def test_presence_layout_round_trip():
    layout = MessageLayout([((2, 3), torch.float32), ((4,), torch.bfloat16)], "the gradient of stage 1's output")
    framed = PresenceLayout(layout)
    grads = [torch.randn(2, 3), torch.zeros(4, dtype=torch.bfloat16)]
    wire = framed.pack(grads, (True, False), torch.device("cpu"))
    assert wire.numel() == framed.nbytes == 16 + layout.nbytes
    tensors, present = framed.unpack(wire)
    assert present == (True, False)
    assert torch.equal(tensors[0], grads[0]) and not tensors[1].any()


@pytest.mark.xfail(strict=True, reason="torch.distributed.pipelining sends zeros for a gradient that is None "
                   "(PipelineStage.get_bwd_send_ops), so the weight behind it gets a zero gradient and decays")
def test_unreached_weight_under_torch_engine(tmp_path):
    plan = plan_with(profile_of(ENTRY), [2], 1, 4)
    state = execute(plan, tmp_path, steps=2, lr=1e-3, extra=[*ADAMW, "--engine", "torch"])
    reference = reference_state(plan, steps=2, lr=1e-3, optimizer="adamw", training=dict(weight_decay=0.1))
    assert max_abs_diff(state, reference) <= 1e-5
