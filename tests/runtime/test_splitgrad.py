"""runtime/splitgrad.py: a backward in two parts gives the whole backward's gradients, computes no
weight gradient in its first part, and accumulates like backward (hooks included); the data-parallel
buckets of a zero-bubble list are armed at the last weight backward."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.pipeline.actions import ActionKind
from planner.pipeline.schedule import build_schedule
from runtime.groups import last_backwards
from runtime.splitgrad import backward_input, backward_weight


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
    pending = backward_input(split_model(x1, z), grads, [x1], list(split_model.parameters()))
    assert all(p.grad is None for p in split_model.parameters())  # no weight gradient yet
    input_grad_after_first_part = x1.grad
    backward_weight(pending)

    x2 = x.clone().requires_grad_(input_grad)
    pairs = [(out, g) for out, g in zip(whole_model(x2, z), grads) if out.requires_grad]
    torch.autograd.backward([out for out, _ in pairs], [g for _, g in pairs])
    for p, q in zip(split_model.parameters(), whole_model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    assert len(hooked) == len(list(split_model.parameters()))  # as backward: each parameter's hook once
    if input_grad:
        assert torch.allclose(input_grad_after_first_part, x2.grad, atol=1e-6)


def test_buckets_are_armed_at_the_last_weight_backward():
    lists = build_schedule("zb-h1", 2, 4)
    stage = SimpleNamespace(module=nn.Linear(2, 2))  # what last_backwards reads of a stage
    arming = last_backwards(lists[0], {0: stage}, tied=set())
    last_w = max(k for k, a in enumerate(lists[0]) if a.kind is ActionKind.BACKWARD_WEIGHT)
    assert list(arming) == [(0, lists[0][last_w].micro_batch)]
    assert {id(p) for p in arming[(0, lists[0][last_w].micro_batch)]} == {id(p) for p in stage.module.parameters()}
