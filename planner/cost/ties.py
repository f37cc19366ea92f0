"""Tied weights held once per rank: the copies that the per-unit sums count too many times.

A captured unit's parameter and trainable bytes include every tied weight it uses
(planner.profile.records, for measured and analytic profiles alike), so a sum over the units a rank holds
counts tied weight t once per use. The runtime holds one copy per rank (runtime.stage: one
parameter object, frozen or not), and a trainable tie whose uses span ranks leaves the
data-parallel exchange: its gradients are summed in its own all-reduce over every holder
(runtime.groups; the ("tie", t) collective; a frozen one has no gradient: no collective). So with
k_i uses of t on rank i, the model takes off

    memory                          (k_i - 1) copies   (when k_i >= 1; frozen ties too)
    optimizer step                  (k_i - 1) copies   (trainable ties)
    data-parallel exchange          k_i copies when t spans ranks, else k_i - 1; under local SGD
                                    k_i - 1 (the model averaging covers every parameter a rank holds,
                                    runtime.localsgd); trainable ties only

Under ZeRO-3 (`parameters`) a rank keeps its copy whole (`kept_whole`: t spans ranks and trains, or
k_i >= 2) and FSDP2 never gathers or reduce-scatters it (runtime.shard_params: ignored parameters),
so the sharded exchange takes off all k_i copies, frozen ties too (their forward gathers, and the
backward gathers of the uses whose backward runs: `TieCopy.regathered`), and a trainable tie on
this rank alone is all-reduced whole once per step over the data-parallel group instead
(`ParameterSharding.step`; `Surplus.whole_reduced`; a spanning one has its own all-reduce). A rank
with k_i = 1 of a tie on it alone, or of a frozen tie spanning ranks, shards and gathers it as
any other parameter.

A copy is c_t = min(bytes_t, B_u over t's uses u), B_u the unit's trainable bytes (its parameter
bytes for a frozen tie): a use's unit holds the tie (a profile whose units do not hold it whole
takes off no more than they hold). Its optimizer step is the smallest of its uses' steps in
proportion, o_u c_t / T_u (the profile times each unit's step, not each parameter's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from planner.cost.ranges import RangeCosts
from planner.profile.profile import Profile

Tie = Tuple[str, List[int], int]  # (name, sorted unit indices, bytes): a trainable tie (`shared_parameters`)


class TiedWeight(NamedTuple):
    """A weight several units use (the profile's shared_parameters entry): its units' indices, sorted."""

    name: str
    units: List[int]
    bytes_: int
    trainable: bool


def tied_weights(profile: Profile) -> List[TiedWeight]:
    """Every tied weight in profile.extra, frozen or not; ValueError if malformed."""
    index = {u.name: i for i, u in enumerate(profile.units)}
    out = []
    for entry in profile.extra.get("shared_parameters", []) or []:
        try:
            name, units, size = str(entry["name"]), list(entry["units"]), int(entry["bytes"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"malformed shared_parameters entry {entry!r}: needs name, units, bytes") from None
        missing = [u for u in units if u not in index]
        if missing:
            raise ValueError(f"shared parameter {name!r} names unknown units {missing}")
        out.append(TiedWeight(name, sorted({index[u] for u in units}), size, entry.get("trainable", True) is not False))
    return out


def shared_parameters(profile: Profile) -> List[Tie]:
    """(name, sorted unit indices, bytes) of each trainable tied weight, whose gradients are summed
    across the ranks using it (a frozen one has none: not listed); ValueError if malformed."""
    return [(t.name, t.units, t.bytes_) for t in tied_weights(profile) if t.trainable]


@dataclass(frozen=True)
class TieCopy:
    """What one copy of tied weight `name` is in the per-unit sums: `bytes_` parameter bytes (trainable
    ones too, unless frozen) and `step_s` seconds of optimizer step at speed 1; `uses`: its units."""

    name: str
    uses: Tuple[int, ...]
    bytes_: float
    step_s: float
    trainable: bool = True
    size: float = 0.0  # the tied weight's own bytes (its all-reduce's)
    # per use, the copy's bytes ZeRO-3 gathers again for that unit's backward (a frozen tie's, where
    # the unit's backward runs: planner.cost.ranges `fb`; a trainable tie's gradients are exchanged)
    regathered: Tuple[float, ...] = ()

    @property
    def trained_bytes(self) -> float:
        return self.bytes_ if self.trainable else 0.0


def tie_copies(ties: Sequence[TiedWeight], costs: RangeCosts) -> List[TieCopy]:
    """One TieCopy per tied weight (module docstring: c_t and its step)."""
    out = []
    for tie in ties:
        name, uses, size, trainable = tie.name, tie.units, tie.bytes_, tie.trainable
        counted = costs.t if trainable else costs.p
        held = min([float(size)] + [float(counted[u]) for u in uses])
        steps = [float(costs.o[u]) * held / float(costs.t[u]) for u in uses if costs.t[u] > 0] if trainable else []
        held = max(held, 0.0)
        again = tuple(0.0 if trainable else min(held, float(costs.fb[u])) for u in uses)
        out.append(TieCopy(name, tuple(uses), held, min(steps, default=0.0), trainable, float(size), again))
    return out


@dataclass(frozen=True)
class Surplus:
    """Per device, what the per-unit sums count beyond what it holds: `held` parameter bytes (of them
    `held_trained` trainable), `exchanged` trainable bytes (data-parallel exchange) and `step_s` (at
    speed 1); under ZeRO-3 also the frozen bytes it keeps whole, `ungathered` (of them
    `ungathered_backward` in units whose backward runs), and what it exchanges instead:
    `whole_reduced` trainable bytes all-reduced whole once per step (module docstring)."""

    held: List[float]
    held_trained: List[float]
    exchanged: List[float]
    step_s: List[float]
    ungathered: List[float]
    ungathered_backward: List[float]
    whole_reduced: List[float]

    @staticmethod
    def zero(devices: int) -> "Surplus":
        return Surplus(*([0.0] * devices for _ in range(7)))


def uses_per_device(tie: TieCopy, unit_device: Sequence[int]) -> Dict[int, int]:
    """device -> how many of the tie's uses it holds (the devices holding it; it spans devices when
    there are several)."""
    uses: Dict[int, int] = {}
    for u in tie.uses:
        uses[unit_device[u]] = uses.get(unit_device[u], 0) + 1
    return uses


def surplus(copies: Sequence[TieCopy], unit_device: Sequence[int], devices: int, averaged: bool = False,
            shard: str = "none") -> Surplus:
    """The surplus of each device given the device of every unit (module docstring); averaged:
    under local SGD (the exchange averages each held copy, spanning or not); shard: the ZeRO stage
    (only `parameters` changes the exchange)."""
    held, trained, exchanged, step, ungathered, again, whole = ([0.0] * devices for _ in range(7))
    for tie in copies:
        uses = uses_per_device(tie, unit_device)
        spans = len(uses) > 1 and not averaged
        for i, k in uses.items():
            held[i] += (k - 1) * tie.bytes_
            trained[i] += (k - 1) * tie.trained_bytes
            zero3_whole = shard == "parameters" and not averaged and kept_whole(shard, tie.trainable, spans, k)
            if tie.trainable:  # a frozen tie exchanges and steps nothing
                step[i] += (k - 1) * tie.step_s
                exchanged[i] += (k if spans or zero3_whole else k - 1) * tie.bytes_
                if zero3_whole and not spans:  # all-reduced here whole, once per step
                    whole[i] += tie.bytes_
            elif zero3_whole:  # never gathered on this device
                ungathered[i] += k * tie.bytes_
                again[i] += sum(r for u, r in zip(tie.uses, tie.regathered) if unit_device[u] == i)
    return Surplus(held, trained, exchanged, step, ungathered, again, whole)


def copy_static(copies: Sequence[TieCopy], factors: Tuple[float, float]) -> np.ndarray:
    """Per tie, the static bytes of one copy as the per-unit sums count it: beta_w c_t + beta_t c_t
    (beta_w c_t for a frozen one)
    (`factors`: planner.cost.model.static_factors, the bytes held per parameter and trainable byte)."""
    weights, training = factors
    return np.array([weights * tie.bytes_ + training * tie.trained_bytes for tie in copies], dtype=float)


def kept_whole(shard: str, trainable: bool, spans: bool, uses_here: int) -> bool:
    """Whether a rank keeps its copy of a tied weight whole (unsharded) under this ZeRO stage, as the
    runtime does: `gradients` keeps a tie spanning ranks out of its owners' shares (runtime.shard:
    every holder steps it), `parameters` keeps it out of FSDP2's shards, and also any weight two of
    the rank's units read (runtime.shard_params), frozen or not; `optimizer` shards it with the rest
    (ZeroRedundancyOptimizer over every trainable parameter)."""
    if shard == "gradients":
        return trainable and spans
    if shard == "parameters":
        return (trainable and spans) or uses_here >= 2
    return False


def static_surplus(copies: Sequence[TieCopy], statics: Sequence[float], unit_device: Sequence[int],
                   devices: int, wholes: Optional[Sequence[float]] = None, shard: str = "none") -> List[float]:
    """Per device, the static bytes the per-unit sums count beyond the one copy of each tie it holds:
    (k_i - 1) copies (`statics`: `copy_static`), less what a copy kept whole holds beyond a sharded
    one (`wholes`: `copy_static` unsharded; `kept_whole`)."""
    out = [0.0] * devices
    for t, (tie, static) in enumerate(zip(copies, statics)):
        uses = uses_per_device(tie, unit_device)
        for i, k in uses.items():
            out[i] += (k - 1) * static
            if wholes is not None and kept_whole(shard, tie.trainable, len(uses) > 1, k):
                out[i] -= wholes[t] - static
    return out


def range_static_surplus(copies: Sequence[TieCopy], statics: Sequence[float], num_units: int,
                         starts: Optional[Sequence[int]] = None, wholes: Optional[Sequence[float]] = None,
                         shard: str = "none") -> np.ndarray:
    """[a, e]: `static_surplus` of a device holding units [a, e) alone (the copies of each tie's uses
    in [a, e) beyond one, less a whole copy's excess), for a in `starts` (default every cut 0..L)."""
    L = num_units
    first = np.arange(L + 1) if starts is None else np.asarray(starts)
    out = np.zeros((len(first), L + 1))
    for t, (tie, static) in enumerate(zip(copies, statics)):
        before = np.zeros(L + 1)  # uses among the first a units
        for u in tie.uses:
            before[u + 1:] += 1
        uses = before[None, :] - before[first][:, None]  # in [a, e)
        out += np.maximum(uses - 1, 0) * static
        if wholes is not None and wholes[t] != static:
            n = len(tie.uses)  # whether k uses on one device keep the tie whole, per k
            whole = np.array([k >= 1 and kept_whole(shard, tie.trainable, k < n, k) for k in range(n + 1)])
            out -= np.where(whole[np.clip(uses, 0, n).astype(int)], wholes[t] - static, 0.0)
    return out


def later_uses_bytes(copies: Sequence[TieCopy], num_units: int, trained: bool = False) -> np.ndarray:
    """Per unit, the copies of ties it uses other than their first use (their trainable bytes if
    `trained`): taken off every unit's bytes, a range's sum is at most what any rank holding it
    keeps (a lower bound per stage)."""
    out = np.zeros(num_units)
    for tie in copies:
        for u in tie.uses[1:]:
            out[u] += tie.trained_bytes if trained else tie.bytes_
    return out
