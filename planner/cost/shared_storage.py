"""The storages two neighbouring units both hold, from the profile's storages by value name
(UnitProfile.shared_saved_bytes, weight_shared_bytes, recomputed_shared_bytes, dropped_saved_bytes): the
d_k, d^h_k, d'_k, r_k and the recomputed pairs' p_k, u_k, q_k (u'_k) of planner.cost.ranges, which a stage
holding both counts once."""
from __future__ import annotations


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
