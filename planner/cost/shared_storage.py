"""The storages two neighbouring units both hold, from the profile's storages by value name
(UnitProfile.shared_saved_bytes, weight_shared_bytes, recomputed_shared_bytes, dropped_saved_bytes): the
d_k, d^h_k, d'_k, r_k and the recomputed pairs' p_k, u_k, q_k (u'_k) of planner.cost.ranges, which a stage
holding both counts once, and the gaps of two units that are not neighbours.

d_k: the bytes units k - 1 and k both save (one storage: a ReLU's output the next convolution saves
as its input; UnitProfile.shared_saved_bytes), which a stage holding both holds once, unless unit
k - 1 is recomputed (it then saves its input, not its output; a recomputed unit k saves its input,
the shared tensor still).

d'_k: of d^h_k, what unit k still holds after its input part (UnitProfile.weight_shared_bytes; d_k where
not measured): a stage's last unit may let a storage it shares with the unit before go, which that
unit, inside the stage, still holds.

p_k, u_k, q_k: what a stage holding units k - 1 and k holds once of what both hold where one or both are
recomputed (`shares`, by value name; a recomputed unit keeps its inputs, UnitProfile.recomputed_shared_bytes):
p_k, only k recomputed, what it keeps of what unit k - 1 saves (a skip that unit k - 1 saves and k only passes
on, long_skip's encoder output; a model input both read, gpt's tokens: the embedding saves them, pos_emb reads
their shape; less than d_k where k, recomputed, no longer saves all it shared with k - 1: rotary tables both
layers save, which a recomputed layer makes again inside itself); u_k, only k - 1 recomputed, what it keeps of
what unit k saves (an input both read, which k saves: a scale's table each layer multiplies by); q_k, both, what
both keep (a value every layer reads: a gate, a position table; one storage, which each layer's checkpoint
keeps). p_k = d_k + r_k where unit k's kept storages are not measured (q_k = 0 then, u_k where unit k - 1's
are not). o^h_k:
the same of what both still hold as the forward returns (d^h_k, p^h_k, u^h_k, q^h_k: less x; a recomputed unit
attached to no graph keeps none of its inputs); o'_k: of o^h_k with unit k not recomputed, what unit k still
holds after its input part (d'_k, u'_k: weight_shared_bytes). The sum of o_k is exact for two neighbours (a
storage three units hold, the middle one not, still counts twice: an over-count) but not additive in the
recomputed set: the solvers' rows hold each cut's pair of recomputed neighbours as a product
(planner.cost.stage_memory's `pair`); the additive forms (chain_recompute.freed_bytes, the greedy's) count
r_k = min(p_k - d_k, q_k) where k is recomputed, whichever k - 1 is, and nothing for u_k: never more than the
two cases hold once (an upper bound of the bytes held; the lower bounds take max(p_k - d_k, q_k - u_k)).

gaps (l, j, x), j >= l + 2: x bytes of one storage (by value name) that units l and j both save and no unit
between them does (shared_storage.gap_shares: an FPN's feature map its ReLU saves as output and a head two units
on as input; a Perceiver's encoded inputs both cross attentions save; a model input read at both ends of a stage).
The d_k count it once per holder; a stage holding l .. j holds it once. Only where none of l .. j is recomputed
(a recomputed unit between keeps its cut's values, this one among them, and the neighbours' p_k, u_k count that;
a recomputed end keeps its inputs: an over-count left, never under); additive in the split, not in R (the
solvers' additive forms take x off each of l .. j's freed bytes: an upper bound of the bytes held). held_gaps: the
same of what both still hold as the forward returns (held_saved; a later zero-bubble stage's weight_held, whose
last unit holds its h, counts none: an over-count left).

All of these name a storage as it is inside a stage. Views of one storage crossing a cut (a coupling layer's
x[:, :k] and x[:, k:]) arrive apart at a stage starting there, each a storage of its own: such a stage counts
them by the views it receives (planner.cost.received, which makes these terms, `storage_terms`, of the units as
it sees them).
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np


def shared(before, after, b: int, held: bool = False, weight: bool = False) -> float:
    """The bytes two neighbouring units both save (their shared_saved_bytes at b, by value); with
    `held`, of them those both still hold as the forward returns (less dropped_saved_bytes); with
    `weight`, those `before` so holds and `after` still holds after its input part
    (weight_shared_bytes; all of them where not measured)."""
    first, second = before.shared_saved_bytes.get(b) or {}, after.shared_saved_bytes.get(b) or {}
    if held or weight:
        first = _held_shares(before, b)
        second = after.weight_shared_bytes[b] if weight and b in after.weight_shared_bytes else _held_shares(after, b)
    return _overlap(first, second)


def _overlap(first: dict, second: dict) -> float:
    """The bytes two units' storages by value name ({name: bytes}) have in common."""
    return float(sum(min(first[v], second[v]) for v in first.keys() & second.keys()))


def _held_shares(unit, b: int) -> dict:
    """Of a unit's shared_saved_bytes at b, what it still holds as its forward returns."""
    dropped = unit.dropped_saved_bytes.get(b) or {}
    return {v: n - dropped.get(v, 0) for v, n in (unit.shared_saved_bytes.get(b) or {}).items() if n > dropped.get(v, 0)}


def redo_shared(before, after, b: int, dup: float) -> float:
    """r_k of units k - 1 (`before`) and k (`after`) at b, `dup` their d_k: of the storages a recomputed
    `after` keeps (recomputed_shared_bytes), those `before` saves, less d_k, and at most those `before`
    keeps when recomputed itself (what a stage holding both holds once in every case: module
    docstring); 0 where not measured. Negative where `after`, recomputed, no longer saves what it shared
    with `before` (rotary tables both layers save, which the recomputed one makes again inside itself):
    the d_k the stage's count took off comes back (it was 0 there: a rank held 384 bytes a micro-batch
    more than planned)."""
    kept = after.recomputed_shared_bytes.get(b)
    if not kept:
        return 0.0
    saved, inputs = before.shared_saved_bytes.get(b) or {}, before.recomputed_shared_bytes.get(b) or {}
    return min(_overlap(saved, kept) - dup, _overlap(inputs, kept))


def redo_shares(before, after, b: int, held: bool = False, gone=(False, False)):
    """(p_k, u_k, q_k) of units k - 1 (`before`) and k (`after`) at b: the bytes both hold where only `after`
    is recomputed (what it keeps, recomputed_shared_bytes, of what `before` saves), only `before` is (what
    `before` keeps of what `after` saves) and both are (what both keep); with `held`, of them those both still
    hold as the forward returns (a unit's saves less dropped_saved_bytes; a recomputed unit attached to no
    graph, `gone`, holds none of what it keeps). 0 where not measured."""
    saved_before, saved_after = (_held_shares(before, b), _held_shares(after, b)) if held else \
        (before.shared_saved_bytes.get(b) or {}, after.shared_saved_bytes.get(b) or {})
    kept_before = {} if gone[0] else before.recomputed_shared_bytes.get(b) or {}
    kept_after = {} if gone[1] else after.recomputed_shared_bytes.get(b) or {}
    return _overlap(saved_before, kept_after), _overlap(kept_before, saved_after), _overlap(kept_before, kept_after)


def weight_redo_share(before, after, b: int, gone: bool = False) -> float:
    """u'_k: of u^h_k (`redo_shares`, held), what `after`, not recomputed, still holds after its input part
    (weight_shared_bytes; all of them where not measured): a zero-bubble stage's last unit after a recomputed one."""
    kept = {} if gone else before.recomputed_shared_bytes.get(b) or {}
    return _overlap(kept, after.weight_shared_bytes[b] if b in after.weight_shared_bytes else _held_shares(after, b))


def gap_shares(units, b: int, held: bool = False):
    """[(l, j, bytes)]: storages units l and j >= l + 2 both save (shared_saved_bytes, by value name) that no unit
    between them saves: consecutive holders of one value that are not neighbours (FPN's feature map, which its
    ReLU saves as output and the shared head's convolution two units on as input; a Perceiver's encoded inputs,
    which both cross attentions save; a model input read at both ends of a stage). The d_k of neighbours count
    such a storage once per holder: a stage holding l .. j without recomputing any of them holds it once more
    than it saves (planner.cost.ranges' gap term). With `held`, of what both still hold as the forward returns."""
    dicts = [_held_shares(unit, b) if held else (unit.shared_saved_bytes.get(b) or {}) for unit in units]
    last: dict = {}  # value name -> the last unit so far saving it
    out: dict = {}
    for j, saves in enumerate(dicts):
        for name, n in saves.items():
            l = last.get(name)
            if l is not None and l < j - 1:
                out[l, j] = out.get((l, j), 0.0) + float(min(dicts[l][name], n))
            last[name] = j
    return [(l, j, x) for (l, j), x in sorted(out.items()) if x]


def kept_inputs(units, b: int, received: np.ndarray) -> np.ndarray:
    """in_l, what a recomputed unit l keeps inside a stage (its checkpoint's arguments, each storage once), from
    `received`, the same as a stage starting at l receives them (each value a storage of its own: the bytes of
    the values crossing cut l, the model inputs it reads, what the loss saves). Arguments viewing one storage X
    (UnitProfile.received_parts: an unrolled LSTM's x and its step x[:, t], a block's sequence and its class
    token) are X once inside, kept[X] bytes (recomputed_shared_bytes), where received they are each view's bytes:
    a recomputed LSTM step planned 64 bytes a micro-batch more than its rank held. And a view of part of X alone
    (a head reading the last block's class token) keeps all of X: 192 bytes a micro-batch more than planned. Where
    a unit before holds X under another name (its x, where the view's reader names X after the view), X counts
    twice: an over-count, never under. A stage starting where such views arrive apart sees the unit without them
    (planner.cost.received) and counts `received`."""
    out = np.array(received, dtype=float)
    for l, unit in enumerate(units):
        kept = unit.recomputed_shared_bytes.get(b) or {}
        for x, views in (unit.received_parts.get(b) or {}).items():
            if x in kept:
                out[l] += kept[x] - sum(views.values())
    return out


def storage_terms(units, b: int, s: np.ndarray, received: np.ndarray, loss_saved: np.ndarray) -> Dict[str, Any]:
    """planner.cost.ranges.RangeCosts' terms of the storages units save, of `units` at b (s_l, what a recomputed
    unit keeps where it starts a stage and what the loss saves, per unit, given): inputs and weight_inputs (in_l,
    in'_l: `kept_inputs`), dup (d_k), dropped (x_l), held_dup (d^h_k), weight_dup (d'_k), redo_dup (r_k),
    held_inputs and held_weight_inputs (in^h_l, in^h'_l), shares, held_shares, weight_shares (o_k, o^h_k, o'_k by
    which of units k - 1, k are recomputed), gaps and held_gaps (module docstring). Index k = 0 holds 0."""
    L = len(units)
    pairs = range(1, L)
    out: Dict[str, Any] = {}
    out["inputs"] = inputs = kept_inputs(units, b, received)
    out["weight_inputs"] = inputs - loss_saved
    # d_k: bytes units k - 1 and k both save
    out["dup"] = dup = np.array([0.0] + [shared(units[k - 1], units[k], b) for k in pairs], dtype=float)
    # x_l: of s_l, what autograd frees as the forward returns (no node its outputs reach saves it): counted as
    # saved, never held between the backward parts
    out["dropped"] = dropped = np.array([sum((u.dropped_saved_bytes.get(b) or {}).values()) for u in units], float)
    # a unit all of whose saves are so freed (or that saves nothing) attaches to no graph: recomputed, its
    # checkpoint's kept inputs go too (where measured)
    gone = np.array([b in u.dropped_saved_bytes and dropped[l] >= s[l] for l, u in enumerate(units)], dtype=bool)
    # d^h_k: of d_k, what both still hold as the forward returns (the weight kinds' d_k); d'_k: of d^h_k, what unit
    # k still holds after its input part (a zero-bubble stage's last unit may let go what unit k - 1 holds)
    out["held_dup"] = held_dup = np.array([0.0] + [shared(units[k - 1], units[k], b, held=True) for k in pairs])
    out["weight_dup"] = weight_dup = np.array([0.0] + [shared(units[k - 1], units[k], b, weight=True) for k in pairs])
    # r_k: of what a recomputed unit k keeps (its inputs), the bytes the unit before holds too beyond d_k,
    # recomputed or not, at least: the solvers' additive forms
    out["redo_dup"] = np.array([0.0] + [redo_shared(units[k - 1], units[k], b, float(dup[k])) for k in pairs])
    # what a recomputed unit holds between the backward parts: in_l (whole[a]) or in'_l (a later stage), none of
    # it but what the loss saved where the unit attaches to no graph (`gone`)
    out["held_inputs"] = np.where(gone, loss_saved, inputs)
    out["held_weight_inputs"] = np.where(gone, 0.0, inputs - loss_saved)
    # [k, x, y]: the bytes units k - 1 and k both hold, x: unit k - 1 recomputed, y: unit k (d_k, p_k, u_k, q_k);
    # held_shares of what both still hold as the forward returns; weight_shares [k, x]: of held_shares[k, x, 0],
    # what unit k still holds after its input part (d'_k, u'_k)
    shares, held_shares, weight_shares = np.zeros((L, 2, 2)), np.zeros((L, 2, 2)), np.zeros((L, 2))
    for k in pairs:
        before, after = units[k - 1], units[k]
        # (unit k's kept storages not measured: r_k = 0, it keeps what it shares with unit k - 1, d_k)
        measured = bool(after.recomputed_shared_bytes.get(b))
        p, u, q = redo_shares(before, after, b)
        shares[k] = [[dup[k], p if measured else dup[k]], [u, q]]
        p, u, q = redo_shares(before, after, b, held=True, gone=(gone[k - 1], gone[k]))
        held_shares[k] = [[held_dup[k], p if measured else held_dup[k]], [u, q]]
        weight_shares[k] = [weight_dup[k], weight_redo_share(before, after, b, gone[k - 1])]
    out.update(shares=shares, held_shares=held_shares, weight_shares=weight_shares)
    # (l, j, bytes): a storage units l and j >= l + 2 both save and none between them does; of what both still hold
    # as the forward returns (the held kinds')
    out["gaps"], out["held_gaps"] = gap_shares(units, b), gap_shares(units, b, held=True)
    return out


def never_recomputed(costs) -> None:
    """Sets planner.cost.ranges.RangeCosts `costs`' (and its views') recomputable[l]: unit l trains a parameter,
    a value crossing cut l carries a gradient, or it holds bytes for its backward; again[l]: the forward a
    recomputation of unit l runs again (f_l, 0 where not recomputable) and AGAIN its prefix sums. A unit none of
    whose backward needs anything (a frozen embedding reading token ids: autograd builds no graph for it, so it
    saves nothing) would only keep its inputs recomputed and run its forward again: it is never recomputed
    (planner.cost.model's evaluate leaves it out of a plan's recomputation, whose lists the runtime runs), and
    its terms where it is recomputed are its plain ones, so that every count (of a set of units, or the matrices
    of every unit recomputed) counts it as not recomputed: as its inputs (in_l, in^h_l, in^h'_l) what it saves
    (nothing), and as what it and its neighbours share (o_k, o^h_k, o'_k, r_k) what they share where it is not
    recomputed."""
    holds = (costs.s > 0) | (costs.h > 0) | (costs.k > 0) | (costs.first != 0) | (costs.first_held != 0)
    recomputable = (costs.t > 0) | ~costs.whole[:-1] | holds
    again = np.where(recomputable, costs.f, 0.0)
    for one in [costs, *costs.views.values()]:
        one.recomputable, one.again, one.AGAIN = recomputable, again, np.concatenate([[0.0], np.cumsum(again)])
        if not recomputable.all():
            _plain_when_recomputed(one, ~recomputable)


def _plain_when_recomputed(costs, plain: np.ndarray) -> None:
    """The terms of the units in `plain` where recomputed: those where not (never_recomputed). Such a unit saves
    nothing (s_l = x_l = 0: it would be recomputable), so it keeps and holds nothing recomputed either."""
    costs.inputs = np.where(plain, 0.0, costs.inputs)
    costs.weight_inputs = np.where(plain, 0.0, costs.inputs - costs.loss_saved)
    costs.held_inputs = np.where(plain, 0.0, costs.held_inputs)
    costs.held_weight_inputs = np.where(plain, 0.0, costs.held_weight_inputs)
    costs.redo_dup = np.where(plain, 0.0, costs.redo_dup)
    shares, held_shares, weight_shares = costs.shares.copy(), costs.held_shares.copy(), costs.weight_shares.copy()
    for l in np.flatnonzero(plain):
        for table in (shares, held_shares):  # [k, x, y]: x unit k - 1 recomputed, y unit k
            table[l, :, 1] = table[l, :, 0]
            if l + 1 < costs.num_units:
                table[l + 1, 1, :] = table[l + 1, 0, :]
        if l + 1 < costs.num_units:
            weight_shares[l + 1, 1] = weight_shares[l + 1, 0]
    costs.shares, costs.held_shares, costs.weight_shares = shares, held_shares, weight_shares
