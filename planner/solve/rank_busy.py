"""A bound on every split from what each rank's own list takes: its computes, the transfers its
blocking batches wait for, and the cost per message of each operation.

A rank runs its list in order (planner.pipeline.stepgraph): a compute takes its duration, a batch
that receives anything ends no sooner than its post plus the transfer of each of its operations, its
sends included (a send is done only once its message crossed), and every operation costs `message` on
its rank. So for any split the rank ends no sooner than

    sum over its computes + sum over its blocking batches of their longest transfer + n_ops * message

(a batch of sends only is posted without waiting). Each message crosses a boundary next to one of the
rank's own stages: the activation received and the gradient sent at the stage's first cut a_g, the
activation sent and the gradient received at its last e_g. A batch's operations at one cut of one stage
(a "side") wait for the longest of their transfers there, a function of that cut alone; a batch with
several sides receiving waits for the longest side, at least their mean (each weighs one over their
number), except one receiving at both cuts of one stage alone, which waits for the larger of the two
(`both`: a function of the stage's range). Summed per stage:

    B_g(a, e) = m W(a, e) / sigma_g + A_g(a) + E_g(e) + sum_both max(.,.) + n_g * message

with A_g (E_g) the weighted sides at its first (last) cut and n_g the stage's operations, all read from
the lists. A rank's end is at least the sum of its stages' B_g, so every split's step is at least max_g
B_g (an exact min-max partition) and at least the mean over the p ranks of sum_g B_g (the cheapest cuts
for the transfers, a dynamic program over the boundaries).
With several stages per device (v > 1) this is the bound that sees one heavy unit or an expensive
cut; the one-stage-per-device bound (planner.solve.scenario_bound) adds it stage by stage.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from planner.cost.model import boundary_links, rank_speeds, step_shape
from planner.cost.options import CostOptions
from planner.cost.ranges import RangeCosts
from planner.cost.step import StepShape, step_lists
from planner.pipeline.actions import BACKWARD_KINDS, ActionKind
from planner.pipeline.stepgraph import batches_of

Payloads = FrozenSet[str]  # of one side: "act" (activation bytes) and / or "grad" (gradient bytes)
_RECEIVES = (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)
# each message kind: (the side of its stage it crosses, its payload)
_SIDE = {ActionKind.RECV_ACT: ("start", "act"), ActionKind.SEND_GRAD: ("start", "grad"),
         ActionKind.SEND_ACT: ("end", "act"), ActionKind.RECV_GRAD: ("end", "grad")}


@dataclass(frozen=True)
class RankBusy:
    """Per stage g: the sides its blocking batches wait for, weighed (module docstring): at its first cut
    (`starts`), at its last (`ends`), at both (`both`, the larger of the two); its operations; its
    rank's speed."""

    starts: Tuple[Dict[Payloads, float], ...]
    ends: Tuple[Dict[Payloads, float], ...]
    both: Tuple[Dict[Tuple[Payloads, Payloads], int], ...]
    operations: Tuple[int, ...]
    speeds: Tuple[float, ...]
    # per stage its rank backwards first (one stage per device: every stage; 0 for the others): the forwards
    # the rank runs between that micro-batch's forward and backward (what may fill the wait for its crossing
    # of the later stages)
    filling: Tuple[int, ...] = ()

    def weight(self, g: int) -> float:
        """The blocking batches stage g's sides stand for (each batch weighs one over its stages)."""
        return sum(self.starts[g].values()) + sum(self.ends[g].values()) + sum(self.both[g].values())


REGIONS = ("all", "between_computes", "first_wait")


def rank_busy(opts: CostOptions, m: int, region: str = "all", anchor: Tuple[str, int] = ("F", 0)) -> RankBusy:
    """The counts of the scenario's lists (one rank per stage: no replicated stages), over each rank's
    whole list, or (planner.solve.scenario_bound, planner.solve.rank_span) over the batches between its
    first and last compute ("between_computes": what comes before and after lies in its fill and drain),
    or between the forward and the backward of the micro-batch it backwards first ("first_wait": what
    the rank may do while that micro-batch crosses the later stages and back). Another `anchor` (with
    "between_computes"): from that compute on instead (anchor_index; planner.solve.rank_span's later fills)."""
    if region not in REGIONS:
        raise ValueError(f"region {region!r}: one of {', '.join(REGIONS)}")
    shape = step_shape(opts, m)
    speeds = rank_speeds(opts)
    starts, ends, both, operations, filling = _counts(shape, region, anchor)  # (shared: read only)
    return RankBusy(starts, ends, both, operations, tuple(speeds[shape.rank_of(g)] for g in range(opts.num_stages)),
                    filling)


@lru_cache(maxsize=1024)
def rank_items(shape: StepShape) -> Tuple[Tuple[object, ...], ...]:
    """Each rank's list as planner.pipeline.stepgraph.batches_of groups it (fixed by the shape: cached)."""
    return tuple(tuple(batches_of(actions)) for actions in step_lists(shape))


@lru_cache(maxsize=1024)
def _counts(shape: StepShape, region: str, anchor: Tuple[str, int]) -> tuple:
    """rank_busy's counts but the speeds: (starts, ends, both, operations, filling), fixed by the shape."""
    S = shape.num_stages
    starts = [defaultdict(float) for _ in range(S)]
    ends = [defaultdict(float) for _ in range(S)]
    both = [defaultdict(int) for _ in range(S)]
    operations, filling = [0] * S, [0] * S
    for items in rank_items(shape):
        computes = [i for i, item in enumerate(items) if not isinstance(item, tuple)]
        begin = anchor_index(items, anchor)  # ("F", 0): the rank's first compute
        stage, waiting = _first_wait(items, computes)
        if stage is not None:  # the forwards the rank runs meanwhile
            filling[stage] = sum(1 for item in waiting if not isinstance(item, tuple) and item.kind == ActionKind.FORWARD)
        if region == "between_computes":
            items = items[begin:computes[-1]] if computes else ()
        elif region == "first_wait":
            items = waiting
        for item in items:
            if not isinstance(item, tuple):
                continue
            sides: Dict[Tuple[int, str], set] = defaultdict(set)
            receiving = set()
            for a in item:
                operations[a.stage] += 1
                side, payload = _SIDE[a.kind]
                sides[(a.stage, side)].add(payload)
                if a.kind in _RECEIVES:
                    receiving.add((a.stage, side))
            if not receiving:  # sends only: posted without waiting
                continue
            waited = sorted(receiving)
            if len(waited) == 2 and waited[0][0] == waited[1][0]:  # both cuts of one stage ("end" < "start")
                g = waited[0][0]
                both[g][(frozenset(sides[(g, "start")]), frozenset(sides[(g, "end")]))] += 1
                continue
            for g, side in waited:  # the longest side: at least their mean
                (starts if side == "start" else ends)[g][frozenset(sides[(g, side)])] += 1 / len(waited)
    return tuple(map(dict, starts)), tuple(map(dict, ends)), tuple(map(dict, both)), tuple(operations), tuple(filling)


def anchor_index(items: List[object], anchor: Tuple[str, int]) -> int:
    """The index in a rank's items of its anchor (kind, c): the first forward ("F") or backward ("B": whole or
    input part) of the rank's c-th stage in model order (0 for a list without computes)."""
    stages = sorted({item.stage for item in items if not isinstance(item, tuple)})
    if not stages:
        return 0
    kinds = (ActionKind.FORWARD,) if anchor[0] == "F" else BACKWARD_KINDS
    return next(i for i, item in enumerate(items) if not isinstance(item, tuple)
                and item.kind in kinds and item.stage == stages[anchor[1]])


def _first_wait(items: List[object], computes: List[int]) -> Tuple[Optional[int], List[object]]:
    """The stage of the micro-batch a rank backwards first, and the items strictly between that micro-batch's
    forward and backward there ((None, []) for a list without a backward)."""
    first = next((i for i in computes if items[i].kind in BACKWARD_KINDS), None)
    if first is None:
        return None, []
    key = (items[first].stage, items[first].micro_batch)
    forward = next(i for i in computes if items[i].kind == ActionKind.FORWARD
                   and (items[i].stage, items[i].micro_batch) == key)
    return key[0], items[forward + 1:first]


def cut_transfers(costs: RangeCosts, link: Tuple[float, float], gradient: bool = False) -> np.ndarray:
    """RangeCosts.message_s at every cut 0 .. L: the activation's (gradient's) seconds over `link`."""
    bandwidth, latency = link
    size = costs.grad if gradient else costs.act
    return np.where(size > 0, latency + size / bandwidth, 0.0)


def crossing_s(costs: RangeCosts, opts: CostOptions, link: Tuple[float, float], payloads: Sequence[str]) -> np.ndarray:
    """At every cut 0 .. L: one message of each payload ("act", "grad") across a boundary there over `link`,
    each with its cost per message; +inf at 0 and L, where no boundary lies."""
    L = len(costs.act) - 1
    inside = (np.arange(L + 1) > 0) & (np.arange(L + 1) < L)
    seconds = sum(cut_transfers(costs, link, payload == "grad") for payload in payloads)
    return np.where(inside, seconds, np.inf) + len(payloads) * opts.message_s


def crossings_before(costs: RangeCosts, opts: CostOptions, payloads: Sequence[str], after: bool = False) -> np.ndarray:
    """[g, a]: the least the boundaries before stage g take where stage g starts at a (each at its cheapest cut
    <= a, crossing_s; +inf where none fits); `after`: [g, e], the boundaries from stage g on where it ends at e
    (each at its cheapest cut >= e). Only boundaries between stages of two ranks count: stages on one rank
    hand their values over in memory (zb-v's stages p - 1 and p, every boundary where p = 1)."""
    out = np.zeros((opts.num_stages, len(costs.act)))
    for j, link in enumerate(boundary_links(opts)):
        if opts.rank_of_stage(j) == opts.rank_of_stage(j + 1):
            continue
        seconds = crossing_s(costs, opts, link, payloads)
        if after:
            out[:j + 1] += np.minimum.accumulate(seconds[::-1])[::-1]
        else:
            out[j + 1:] += np.minimum.accumulate(seconds)
    return out


class CutWaits:
    """What each stage's rank waits for at the stage's cuts (module docstring), over every range."""

    def __init__(self, busy: RankBusy, costs: RangeCosts, opts: CostOptions, num_units: int):
        L, S = num_units, opts.num_stages
        links = boundary_links(opts)
        inside = (np.arange(L + 1) > 0) & (np.arange(L + 1) < L)

        def transfers(link, payload: str) -> np.ndarray:  # the masks below keep a stage off the cuts it cannot have
            return np.where(inside, cut_transfers(costs, link, payload == "grad"), 0.0)

        # per stage the messages at each start a (boundary g - 1) and end e (boundary g); the first stage
        # starts at 0 only and the last ends at L only, crossing nothing there
        first = np.where(np.arange(L + 1) == 0, 0.0, np.inf)
        self._at_start = [{} if g == 0 else {k: transfers(links[g - 1], k) for k in ("act", "grad")}
                          for g in range(S)]
        self._at_end = [{} if g == S - 1 else {k: transfers(links[g], k) for k in ("act", "grad")}
                        for g in range(S)]
        self._start_mask = [first if g == 0 else np.where(inside, 0.0, np.inf) for g in range(S)]
        self._end_mask = [first[::-1] if g == S - 1 else np.where(inside, 0.0, np.inf) for g in range(S)]
        self.busy, self.message_s = busy, opts.message_s

    def _side(self, tables, payloads: Payloads) -> np.ndarray:
        """The longest of a side's transfers at every cut (0 at a model end, where nothing crosses)."""
        if not tables:
            return 0.0
        return np.maximum.reduce([tables[k] for k in sorted(payloads)])

    def start(self, g: int, both_share: float) -> np.ndarray:
        """A_g(a) + n_g message, plus `both_share` of each `both` batch's wait at a (+inf where g cannot start)."""
        return self._cut(g, both_share, 0) + self.busy.operations[g] * self.message_s

    def end(self, g: int, both_share: float) -> np.ndarray:
        """E_g(e), plus `both_share` of each `both` batch's wait at e (+inf where g cannot end)."""
        return self._cut(g, both_share, 1)

    def _cut(self, g: int, both_share: float, side: int) -> np.ndarray:
        """The weighted waits at stage g's first (side 0) or last (side 1) cut, every cut."""
        tables = (self._at_start, self._at_end)[side][g]
        out = (self._start_mask, self._end_mask)[side][g].copy()
        for payloads, weight in (self.busy.starts, self.busy.ends)[side][g].items():
            out = out + weight * self._side(tables, payloads)
        for pair, count in self.busy.both[g].items():
            out = out + both_share * count * self._side(tables, pair[side])
        return out

    def matrix(self, g: int) -> np.ndarray:
        """[a, e]: A_g(a) + E_g(e) + each `both` batch's larger wait + n_g message."""
        return self.add_to(np.zeros((len(self._start_mask[g]),) * 2), g)

    def add_to(self, out: np.ndarray, g: int, sign: float = 1.0) -> np.ndarray:
        """out += sign * matrix(g), in place (no (L + 1)^2 temporary where no batch waits at both cuts)."""
        out += sign * self.start(g, 0.0)[:, None]
        out += sign * self.end(g, 0.0)[None, :]
        for (at_start, at_end), count in self.busy.both[g].items():
            out += sign * count * np.maximum(np.asarray(self._side(self._at_start[g], at_start))[..., None],
                                             np.asarray(self._side(self._at_end[g], at_end))[None, ...])
        return out

    def least_sum(self) -> float:
        """min over cuts 0 < c_0 < ... < c_{S-2} < L of what every stage waits for, summed (each `both`
        batch as the mean of its two sides, which the larger is at least): a dynamic program over the
        boundaries, boundary j at cut c costing E_j(c) + A_{j+1}(c)."""
        S = len(self._start_mask)
        starts = [self.start(g, 0.5) for g in range(S)]
        ends = [self.end(g, 0.5) for g in range(S)]
        total = float(starts[0][0] + ends[-1][-1])
        best = None  # best[c]: the least over the first j + 1 cuts with cut j at c
        for j in range(S - 1):
            here = ends[j] + starts[j + 1]
            best = here if best is None else \
                here + np.concatenate(([np.inf], np.minimum.accumulate(best)[:-1]))  # a cut left of c
        return total + (float(np.min(best)) if best is not None else 0.0)
