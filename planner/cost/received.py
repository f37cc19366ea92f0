"""Storages a stage receives in parts: the views one storage X makes crossing a cut (a coupling layer's
x[:, :k] and x[:, k:]), as the units of a stage starting at that cut save and keep them.

Inside a stage the views are one storage, which each unit saving any of them saves whole: the profile
names it X with its n_j(X) bytes in the unit's shared_saved_bytes, and the d_k and gaps of
planner.cost.shared_storage count it once. A stage starting at cut a receives each value crossing a in
a storage of its own (runtime.step_state.own_storages; a message's tensors apart): X arrives as its
views v, |v| bytes each, and a unit j >= a reading them saves and keeps those, not X. The profile records
per unit j the storages its arguments view apart, P_j(X) = {v: |v|}, and of them S_j(X), those whose own
storage it saves as received (UnitProfile.received_parts, received_saved_parts). Where every v in P_j(X)
crosses cut a (a model input is a storage of its own in every stage), a stage starting at a sees unit j as

    s^a_j = s_j - n_j(X) + sum_{v in S_j(X)} |v|       (j > a: unit a's own is s_a + first_a, measured)
    h^a_j = h_j - n_j(X) + sum_{v in S_j(X)} |v|       (j > a, where it still holds X after its input part)
    names  X -> the v of S_j(X) where it saves X (held after the input part, dropped, as X is),
               the v of P_j(X) where it keeps X recomputed (its arguments)

and the d_k, p_k, u_k, q_k, o^h_k, o'_k and gaps of those names (shared_storage.storage_terms) over the
units from a on. `views` makes that RangeCosts (`view`) for each such a, and every reader of a stage
starting at a takes it (ranges' `at`): the cost model, the stage tables (planner.cost.stage_memory), the
program's rows (their difference where stage g starts at a: planner.solve.ilp_memory), the chain tables and
the recomputation bounds. Its terms at cuts k <= a are the profile's (the stage holds no unit before a; what
unit a shares with unit a - 1, given back at its start, cancels).

Exact, nothing recomputed, where every unit reading the views reads them as they crossed cut a; with units
recomputed, as exact as the terms are inside a stage (a recomputed end of a gap keeps its inputs: an
over-count, never under; a recomputed unit keeping views two neighbours save one each: exact). A view made inside
the stage (a slice of a received value) leaves X so named for its reader: its storage is a received one, at
most |X| (counted as X: never under). Partly dropped X: its parts counted held. An older profile without
received_parts where a unit's arguments arrive apart (first_saved_bytes): a stage starting there names none of
that unit's storages as the units after it do (an over-count where views part a storage, never under).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Dict, List, Optional

import numpy as np

from planner.cost.shared_storage import storage_terms
from planner.profile.profile import Profile
from planner.profile.unit_profile import NAMED_STORAGE_FIELDS

PART = "received"  # names of received views: (PART, value name), never a node's name
ALONE = "alone"  # an older profile's first unit: (ALONE, storage name)
# the storage terms at cuts <= a that a view keeps from the profile
AT_CUTS = ("dup", "held_dup", "weight_dup", "redo_dup", "shares", "held_shares", "weight_shares")


def apart_starts(profile: Profile, b: int) -> Dict[int, Dict[int, Optional[Dict[str, Dict[str, int]]]]]:
    """{a: {j: {X: P_j(X)}}}: for each cut a >= 1, the units j >= a that a stage starting there sees with storages
    received apart, and those storages (every view crossing cut a, or a model input); None for an older
    profile's unit a, which names none of its storages as later units do (module docstring)."""
    out: Dict[int, Dict[int, Optional[Dict[str, Dict[str, int]]]]] = {}
    apart = []
    for j, unit in enumerate(profile.units[1:], start=1):
        parts = unit.received_parts.get(b)
        if parts:
            apart.append((j, parts))
        elif parts is None and b in unit.first_saved_bytes and any((getattr(unit, name).get(b) or {}) for name in (
                "shared_saved_bytes", "recomputed_shared_bytes")):
            out.setdefault(j, {})[j] = None
    if not apart:
        return out
    crossing = [set()] + [{v.name for v in profile.cut(k).values} for k in range(1, profile.num_units)]
    anywhere = set().union(*crossing)
    for j, parts in apart:
        for x, views in parts.items():
            for a in range(j, 0, -1):  # a view crosses the cuts from the one after its maker's to its last reader's
                if not all(v in crossing[a] or v not in anywhere for v in views) or \
                        not any(v in crossing[a] for v in views):
                    break
                found = out.setdefault(a, {}).setdefault(j, {})
                if found is not None:
                    found[x] = views
    return out


def _seen(unit, b: int, apart: Optional[Dict[str, Dict[str, int]]], first: bool):
    """Unit j as a stage starting at a sees it (module docstring); `first`: j = a (its counts are measured as
    received, first_saved_bytes); `apart` None: an older profile's unit a, its storages named apart."""
    shared = dict(unit.shared_saved_bytes.get(b) or {})
    kept = dict(unit.recomputed_shared_bytes.get(b) or {})
    held = dict(unit.weight_shared_bytes[b]) if b in unit.weight_shared_bytes else None
    dropped = dict(unit.dropped_saved_bytes.get(b) or {})
    if apart is None:
        rename = lambda d: {(ALONE, x) if x else x: n for x, n in d.items()}  # noqa: E731 ("" is no storage)
        shared, kept, dropped = rename(shared), rename(kept), rename(dropped)
        held = None if held is None else rename(held)
    less = held_less = 0
    for x, views in (apart or {}).items():
        saved = {(PART, v): n for v, n in (unit.received_saved_parts.get(b) or {}).get(x, {}).items()}
        if x in kept:
            del kept[x]
            kept.update({(PART, v): n for v, n in views.items()})
        if x not in shared:
            continue
        n = shared.pop(x)
        shared.update(saved)
        less += n - sum(saved.values())
        if held is not None and x in held:
            held_less += held.pop(x) - sum(saved.values())
            held.update(saved)
        if dropped.pop(x, 0) >= n:
            dropped.update(saved)
    counts = {}
    if not first:
        counts["saved_bytes"] = {**unit.saved_bytes, b: unit.saved_bytes[b] - less}
        if unit.split_backward:
            counts["weight_held_bytes"] = {**unit.weight_held_bytes, b: unit.weight_held_bytes[b] - held_less}
    # the storages it receives apart are no longer views of one storage among its arguments (in_l as received)
    parts = {**unit.received_parts, b: {x: v for x, v in unit.received_parts[b].items() if x not in apart}} \
        if apart else unit.received_parts
    return dataclasses.replace(
        unit, received_parts=parts, shared_saved_bytes={b: shared}, recomputed_shared_bytes={b: kept} if kept else {},
        weight_shared_bytes={} if held is None else {b: held},
        dropped_saved_bytes={b: dropped} if b in unit.dropped_saved_bytes else {}, **counts)


def seen_from(profile: Profile, b: int, a: int, apart) -> List:
    """The profile's units as a stage starting at cut a sees them (`apart`: apart_starts(profile, b)[a])."""
    units = list(profile.units)
    for j, parts in apart.items():
        units[j] = _seen(units[j], b, parts, first=j == a)
    return units


def views(costs, profile: Profile) -> Dict[int, object]:
    """{a: RangeCosts}: for each cut a where a stage receives a storage apart, `costs` with the storage terms of
    the units as such a stage sees them (`seen_from`), its terms at cuts <= a the profile's; its own `views`
    none (its `at` is itself). Made over the units from a to the last holder of a storage named apart (the
    terms of the rest are the profile's)."""
    b, out, L = costs.b, {}, costs.num_units
    starts = apart_starts(profile, b)
    if not starts:  # (most profiles: nothing more to read)
        return out
    last: Dict[object, int] = {}  # a storage's name -> the last unit naming it
    for l, unit in enumerate(profile.units):
        last.update(dict.fromkeys(_names(unit, b), l))
    for a, apart in sorted(starts.items()):
        units = seen_from(profile, b, a, apart)
        named = {x for j, parts in apart.items() for x in (parts or _names(profile.units[j], b))}
        lo, hi = a, min(L, max([max(apart) + 2] + [last.get(x, 0) + 2 for x in named]))
        window = units[lo:hi]
        s, h = costs.s.copy(), costs.h.copy()
        s[lo:hi] = [u.saved_bytes[b] for u in window]
        h[lo:hi] = [u.weight_held_bytes[b] if u.split_backward else u.saved_bytes[b] for u in window]
        terms = storage_terms(window, b, s[lo:hi], costs.received_inputs[lo:hi], costs.loss_saved[lo:hi])
        view = copy.copy(costs)
        for name, value in terms.items():
            if name in ("gaps", "held_gaps"):
                setattr(view, name, [p for p in getattr(costs, name) if p[0] < lo or p[1] >= hi] +
                        [(l + lo, j + lo, x) for l, j, x in value])
                continue
            whole = getattr(costs, name).copy()
            if name in AT_CUTS:  # (a cut's: units k - 1, k both in the window from its second cut on)
                whole[lo + 1:hi] = value[1:]
            else:
                whole[lo:hi] = value
            setattr(view, name, whole)
        vars(view).update(s=s, h=h, S=np.concatenate([[0.0], np.cumsum(s)]), views={})
        out[a] = view
    return out


def _names(unit, b: int) -> set:
    """Every storage name a unit gives at b (an older profile's renamed apart where it starts a stage)."""
    return {x for name in NAMED_STORAGE_FIELDS for x in getattr(unit, name).get(b) or {}}


def gap_row(costs, a: int) -> np.ndarray:
    """gap(a, e) over e = 0 .. L (ranges' gap: the pairs l >= a, j < e), nothing recomputed."""
    row = np.zeros(costs.num_units + 1)
    for l, j, x in costs.gaps:
        if l >= a:
            row[j + 1] += x
    return np.cumsum(row)


def saved_correction(costs, recompute_all: bool = False) -> Optional[np.ndarray]:
    """ranges' saved(a, e) less its prefix form, saved_prefix[e] - saved_prefix[a] + saved_at_start[a], over every
    cell [a, e] (0 where e <= a), every unit recomputed or none: the gaps (none recomputed: -gap_matrix) and the
    rows of the starts a stage receives a storage apart at (their view's less the profile's); None where 0."""
    out = None if recompute_all or not costs.gaps else -costs.gap_matrix()
    cuts = np.arange(costs.num_units + 1)
    for a, view in costs.views.items():
        out = np.zeros((costs.num_units + 1,) * 2) if out is None else out
        mine, theirs = costs.saved_prefix(recompute_all), view.saved_prefix(recompute_all)
        row = theirs - theirs[a] + view.saved_at_start(recompute_all)[a] - \
            (mine - mine[a] + costs.saved_at_start(recompute_all)[a])
        out[a] = np.where(cuts > a, row - (0.0 if recompute_all else gap_row(view, a)), 0.0)
    return out
