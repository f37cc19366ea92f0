"""A bound on every split from what each rank's own list takes: its computes, the transfers its
blocking batches wait for, and the cost per message of each operation.

A rank runs its list in order (planner.pipeline.stepgraph): a compute takes its duration, a batch
that receives anything ends no sooner than its post plus the transfer of each of its operations, and
every operation costs `message` on its rank. So for any split the rank ends no sooner than

    sum over its computes + sum over its blocking batches of the mean of their receives' transfers
                          + n_ops * message

(receives in one batch cross together: the batch waits for the longest, at least their mean; a batch
of sends only is posted without waiting). Each receive is a message across a boundary next to one of
the rank's own stages: the activation at the stage's first cut a_g, the gradient at its last e_g.
Summed per stage:

    B_g(a, e) = m W(a, e) / sigma_g + A_g(a) + E_g(e) + n_g * message

with A_g(a) = n^act_g t^act_{g-1}(a) and E_g(e) = n^grad_g t^grad_g(e), the counts (each receive weighed
by one over the receives in its batch) and n_g (the stage's operations) read from the lists. A rank's
end is at least the sum of its stages' B_g, so every split's step is at least max_g B_g (an exact
min-max partition) and at least the mean over the p ranks of sum_g B_g (the cheapest cuts for the
transfers, a dynamic program over the boundaries).
With several stages per device (v > 1) this is the bound that sees one heavy unit or an expensive
cut; the one-stage-per-device bound (planner.solve.scenario_bound) adds it stage by stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from planner.cost.model import boundary_links, rank_speeds, step_shape
from planner.cost.options import CostOptions
from planner.cost.ranges import RangeCosts
from planner.cost.step import step_lists
from planner.pipeline.actions import ActionKind
from planner.pipeline.stepgraph import batches_of

_RECEIVES = (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)


@dataclass(frozen=True)
class RankBusy:
    """Per stage g: its receives (activations at its first cut, gradients at its last), each weighed by
    one over the receives of its batch, except the batches receiving one activation and one gradient of
    g alone (`together`: they wait for the longer of the two); its operations; its rank's speed."""

    activations: Tuple[float, ...]  # n^act_g, across boundary g - 1
    gradients: Tuple[float, ...]  # n^grad_g, across boundary g
    together: Tuple[int, ...]  # n^both_g
    operations: Tuple[int, ...]
    speeds: Tuple[float, ...]


def rank_busy(opts: CostOptions, m: int) -> RankBusy:
    """The counts of the scenario's lists (one rank per stage: no replicated stages)."""
    shape = step_shape(opts, m)
    S = opts.num_stages
    activations, gradients, together, operations = [0.0] * S, [0.0] * S, [0] * S, [0] * S
    for actions in step_lists(shape):
        for item in batches_of(actions):
            if not isinstance(item, tuple):
                continue
            for a in item:
                operations[a.stage] += 1
            received = [a for a in item if a.kind in _RECEIVES]  # none: posted without waiting
            kinds = sorted(a.kind.value for a in received)
            if kinds == ["recv_act", "recv_grad"] and received[0].stage == received[1].stage:
                together[received[0].stage] += 1
                continue
            for a in received:  # the batch waits for the longest: at least their mean
                (gradients if a.kind == ActionKind.RECV_GRAD else activations)[a.stage] += 1 / len(received)
    speeds = rank_speeds(opts)
    return RankBusy(tuple(activations), tuple(gradients), tuple(together), tuple(operations),
                    tuple(speeds[shape.rank_of(g)] for g in range(S)))


class CutWaits:
    """What each stage's rank waits for at the stage's cuts (module docstring), over every range."""

    def __init__(self, busy: RankBusy, costs: RangeCosts, opts: CostOptions, num_units: int):
        L, S = num_units, opts.num_stages
        links = boundary_links(opts)
        inside = (np.arange(L + 1) > 0) & (np.arange(L + 1) < L)

        def transfers(link, gradient: bool) -> np.ndarray:  # RangeCosts.message_s at every cut; +inf at 0 and L
            bandwidth, latency = link
            size = costs.grad if gradient else costs.act
            return np.where(inside, np.where(size > 0, latency + size / bandwidth, 0.0), np.inf)

        # per stage the activation received at each start a and the gradient at each end e; the first
        # stage starts at 0 only and the last ends at L only, receiving nothing there
        first = np.where(np.arange(L + 1) == 0, 0.0, np.inf)
        self.act = [first if g == 0 else transfers(links[g - 1], False) for g in range(S)]
        self.grad = [first[::-1] if g == S - 1 else transfers(links[g], True) for g in range(S)]
        self.busy, self.message_s = busy, opts.message_s

    def _start(self, g: int, together_share: float) -> np.ndarray:
        count = self.busy.activations[g] + together_share * self.busy.together[g]
        return _times(count, self.act[g]) + self.busy.operations[g] * self.message_s

    def _end(self, g: int, together_share: float) -> np.ndarray:
        return _times(self.busy.gradients[g] + together_share * self.busy.together[g], self.grad[g])

    def matrix(self, g: int) -> np.ndarray:
        """[a, e]: A_g(a) + E_g(e) + n^both_g max(t^act(a), t^grad(e)) + n_g message."""
        out = self._start(g, 0.0)[:, None] + self._end(g, 0.0)[None, :]
        if self.busy.together[g]:
            out += self.busy.together[g] * np.maximum(self.act[g][:, None], self.grad[g][None, :])
        return out

    def least_sum(self) -> float:
        """min over cuts 0 < c_0 < ... < c_{S-2} < L of what every stage waits for, summed (each batch
        of two receives as their mean, which the longer is at least): a dynamic program over the
        boundaries, boundary j at cut c costing E_j(c) + A_{j+1}(c)."""
        S = len(self.act)
        starts = [self._start(g, 0.5) for g in range(S)]
        ends = [self._end(g, 0.5) for g in range(S)]
        total = float(starts[0][0] + ends[-1][-1])
        best = None  # best[c]: the least over the first j + 1 cuts with cut j at c
        for j in range(S - 1):
            here = ends[j] + starts[j + 1]
            best = here if best is None else \
                here + np.concatenate(([np.inf], np.minimum.accumulate(best)[:-1]))  # a cut left of c
        return total + (float(np.min(best)) if best is not None else 0.0)


def _times(count: float, seconds: np.ndarray) -> np.ndarray:
    """count * seconds, +inf where no cut is (also for a count of 0)."""
    return np.where(np.isfinite(seconds), count * np.where(np.isfinite(seconds), seconds, 0.0), np.inf)
