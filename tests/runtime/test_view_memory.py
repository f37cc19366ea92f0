"""A view of a larger storage keeps all of it: what a rank hands over in memory and what a split backward keeps
for its weight part are given storages of their own, as a received message's tensors are
(runtime.step_state.own_storages), so a rank holds what the plan counts (a value's own bytes), to the byte.

- zb-v: a rank's two stages hand values over in memory. The views one stage sends (an unrolled LSTM's steps
  x[:, t]) stayed views of its sequence, and the next stage saving one kept the whole sequence: 3,712 B held
  where the plan said 3,328 (nothing recomputed), 2,432 on 2,048 (units 1, 2 recomputed).
- zb-h1: a concatenation's backward hands each of its inputs a narrow view of one gradient; the unit before it
  keeps its output's gradient for its weight part, which kept the whole concatenated gradient (the other half
  is the stage's input gradient, sent long before): `cat_inputs`' later rank held 768 B on 640 planned."""
import pytest
import torch

from planner.profile.splitgrad import backward_input, backward_weight
from tests.support.runs import held_and_planned


@pytest.mark.parametrize("entry,args,cuts,schedule,recompute", [
    ("tests.capture_models:unrolled", {"steps": 4}, [1, 3, 4], "zb-v", []),
    ("tests.capture_models:unrolled", {"steps": 4}, [3, 4, 5], "zb-v", [1, 2]),
    ("tests.capture_models:cat_inputs", {}, [2], "zb-h1", []),
])
def test_views_of_a_larger_storage_are_held_as_planned(tmp_path, entry, args, cuts, schedule, recompute):
    for held, planned in held_and_planned(tmp_path, entry, args, cuts, schedule, recompute):
        assert held == planned


def test_a_kept_gradient_viewing_a_concatenations_gradient_keeps_only_itself():
    torch.manual_seed(0)
    d, c = torch.nn.Linear(4, 4), torch.nn.Linear(8, 4)
    h = torch.randn(2, 4, requires_grad=True)  # the stage's received input
    out = c(torch.cat([h, d(h)], -1))
    grad = torch.randn(2, 4)
    pending = backward_input([out], [grad], [h], [*d.parameters(), *c.parameters()])
    kept = pending.kept_gradients()
    assert kept and all(g.untyped_storage().nbytes() == g.numel() * g.element_size() for g in kept)
    backward_weight(pending)
    whole_d, whole_c = torch.nn.Linear(4, 4), torch.nn.Linear(8, 4)
    whole_d.load_state_dict(d.state_dict())
    whole_c.load_state_dict(c.state_dict())
    x = h.detach().requires_grad_(True)
    whole_c(torch.cat([x, whole_d(x)], -1)).backward(grad)
    for p, q in zip([*d.parameters(), *c.parameters()], [*whole_d.parameters(), *whole_c.parameters()]):
        assert torch.equal(p.grad, q.grad)
    assert torch.equal(h.grad, x.grad)


def test_own_storage_copies_only_a_view_of_more():
    from runtime.step_state import own_storages

    whole = torch.randn(4, 6)
    row = whole[1]
    sparse = torch.eye(3).to_sparse()
    got = own_storages([whole, row, sparse])
    assert got[0] is whole and got[2] is sparse  # a storage of its own already; a sparse tensor has none
    assert got[1] is not row and torch.equal(got[1], row)
    assert got[1].untyped_storage().nbytes() == row.numel() * row.element_size()
