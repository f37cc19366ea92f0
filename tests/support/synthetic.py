"""In-memory profiles for tests: no model, no measurement, just numbers."""
from __future__ import annotations

import random
from typing import Dict, Optional, Sequence, Union

from planner.profile.cut_profile import CutProfile, CutValue
from planner.profile.profile import Profile
from planner.profile.unit_profile import UnitProfile

PerSize = Union[float, int, Dict[int, Union[float, int]]]


def _at(value: PerSize, b: int, integral: bool = False):
    """A per-size value: an explicit {b: v} dict, or a per-sample number scaled linearly in b."""
    v = value[b] if isinstance(value, dict) else value * b
    return int(round(v)) if integral else float(v)


def synthetic_profile(forward: Sequence[PerSize], backward: Sequence[PerSize], params: Sequence[int],
                      saved: Sequence[PerSize], cut_act: Sequence[PerSize], cut_grad: Optional[Sequence[PerSize]] = None,
                      sizes: Sequence[int] = (1, 2, 4), names: Optional[Sequence[str]] = None,
                      model: Optional[dict] = None, stage_overhead: Optional[Dict[int, tuple]] = None) -> Profile:
    """A Profile with L = len(forward) units and L - 1 cuts.

    forward/backward (seconds), saved (bytes) and cut_act/cut_grad (bytes crossing cut k = index + 1)
    are per sample (multiplied by b) unless given as {b: value} dicts. Cut k carries one tensor of
    cut_act bytes, with requires_grad; when cut_grad differs from cut_act, the gradient-carrying
    part is a separate tensor ('x', requires_grad) of cut_grad bytes, and the remainder a tensor
    without gradient ('aux'). A cut with 0 bytes carries only a constant. stage_overhead:
    {b: (forward, backward)} seconds every stage pays per micro-batch (Profile.stage_overhead_s).
    """
    L = len(forward)
    assert len(backward) == L and len(params) == L and len(saved) == L and len(cut_act) == L - 1
    cut_grad = list(cut_act) if cut_grad is None else list(cut_grad)
    names = list(names) if names is not None else [f"u{i}" for i in range(L)]
    units = [UnitProfile(name=names[i], param_bytes=int(params[i]),
                         forward_s={b: _at(forward[i], b) for b in sizes},
                         backward_s={b: _at(backward[i], b) for b in sizes},
                         saved_bytes={b: _at(saved[i], b, integral=True) for b in sizes},
                         output_bytes={b: _at(cut_act[i], b, integral=True) if i < L - 1 else 0 for b in sizes},
                         nodes=[names[i]])
             for i in range(L)]
    cuts = []
    for k in range(1, L):
        act = {b: _at(cut_act[k - 1], b, integral=True) for b in sizes}
        grad = {b: _at(cut_grad[k - 1], b, integral=True) for b in sizes}
        values = []
        if any(grad[b] > 0 for b in sizes):
            values.append(CutValue(name=f"x{k}", kind="tensor", dtype="float32", requires_grad=True,
                                   shape={b: [grad[b] // 4] for b in sizes}, bytes=grad))
        rest = {b: act[b] - grad[b] for b in sizes}
        assert all(r >= 0 for r in rest.values()), "gradient bytes cannot exceed activation bytes"
        if any(rest[b] > 0 for b in sizes):
            values.append(CutValue(name=f"aux{k}", kind="tensor", dtype="float32", requires_grad=False,
                                   shape={b: [rest[b] // 4] for b in sizes}, bytes=rest))
        values.append(CutValue(name=f"n{k}", kind="constant", value={b: b for b in sizes}))
        cuts.append(CutProfile(before_unit=k, values=values))
    return Profile(model=model or {"entry": "tests.synthetic:model", "args": {}, "seed": 0},
                   micro_batch_sizes=list(sizes), units=units, cuts=cuts, device="cpu",
                   device_name="synthetic", threads=1, dtype="float32", torch_version="test",
                   stage_overhead_s=dict(stage_overhead or {}))


def random_chain(rng, L: int, sizes: Sequence[int] = (1, 2, 4), stage_overhead: bool = False,
                 frozen: bool = False, apart: bool = False) -> Profile:
    """A random chain of L units (times growing with b, random parameter, saved and cut bytes, half
    of the cuts' activations saved by both neighbours: `share_saved`, and model inputs read by the
    first unit and some others: what they keep when recomputed); with `stage_overhead`,
    half of them also charge every stage a random call cost per micro-batch; with `frozen`, a quarter of
    the units train no parameter (`freeze`); with `apart`, a third of them save more where they start a
    stage (`receive_apart`)."""
    per = lambda lo, hi: {b: rng.uniform(lo, hi) * (0.5 + b) for b in sizes}  # noqa: E731
    profile = synthetic_profile([per(1e-3, 1e-2) for _ in range(L)], [per(2e-3, 2e-2) for _ in range(L)],
                                [rng.randint(0, 8 << 20) for _ in range(L)], [rng.randint(0, 4 << 20) for _ in range(L)],
                                [rng.randint(0, 2 << 20) for _ in range(L - 1)], sizes=sizes,
                                stage_overhead={b: (rng.uniform(0, 2e-3), rng.uniform(0, 3e-3)) for b in sizes}
                                if stage_overhead and rng.random() < 0.5 else None)
    # drawn from a generator of their own, seeded by `rng`'s state without advancing it: callers'
    # later draws (and the benchmarks' chains) stay what they were before these fields existed
    extra = random.Random(repr(rng.getstate()))
    share_saved(profile, [k for k in range(1, L) if extra.random() < 0.5])
    for l, unit in enumerate(profile.units):  # the model's inputs a unit reads (all of them the first)
        if l == 0 or extra.random() < 0.2:
            unit.input_bytes = {b: extra.randint(0, 1 << 20) * b for b in sizes}
    share_kept(profile, [k for k in range(1, L) if extra.random() < 0.25], extra)
    drop_saved(profile, [l for l in range(L) if extra.random() < 0.25], extra)
    if frozen:
        freeze(profile, [l for l in range(L) if extra.random() < 0.25])
    if apart:
        receive_apart(profile, [l for l in range(L) if extra.random() < 0.33], extra)
    return profile


def receive_apart(profile: Profile, units: Sequence[int], rng) -> None:
    """Each unit in `units` saves more where it starts a stage: its inputs arrive each in a storage of its
    own, where inside a stage two are views of one (UnitProfile.first_saved_bytes, planner.cost.ranges'
    first_a; first_weight_held_bytes where it splits its backward). Recomputed, it keeps its inputs
    alone, so it frees these bytes too."""
    for l in units:
        unit, more = profile.units[l], rng.randint(1 << 16, 4 << 20)
        unit.first_saved_bytes = {b: s + more * b for b, s in unit.saved_bytes.items()}
        if unit.split_backward and unit.weight_held_bytes:
            held = rng.randint(0, 2 * more)  # what of them its weight part still holds: more or less
            unit.first_weight_held_bytes = {b: h + held * b for b, h in unit.weight_held_bytes.items()}


def views_apart(profile: Profile, k: int, last: int, rng, parts: int = 2) -> None:
    """A storage X that unit k - 1 makes crosses cuts k .. last as `parts` views of it (a coupling layer's
    x[:, :c] and x[:, c:]), every unit k .. last reading them all: some of those units save X (views of it:
    the whole storage inside a stage; a random nonempty set of the views, each in a storage of its own, where
    they arrive so) and each keeps X recomputed (UnitProfile.received_parts, received_saved_parts; the stage
    starting at a cut k .. last receives the views apart: planner.cost.received)."""
    draws = [rng.randint(1, 1 << 16) for _ in range(parts)]
    names = [f"view{k}_{i}" for i in range(parts)]
    for c in range(k, last + 1):
        profile.cut(c).values.extend(CutValue(name=v, kind="tensor", dtype="float32", requires_grad=True,
                                              shape={b: [n * b] for b in profile.micro_batch_sizes},
                                              bytes={b: 4 * n * b for b in profile.micro_batch_sizes})
                                     for v, n in zip(names, draws))
    X = f"whole{k}"
    for j in range(k, last + 1):
        unit, saves = profile.units[j], rng.random() < 0.6
        saved = rng.sample(names, rng.randint(1, parts)) if saves else []
        for b in profile.micro_batch_sizes:
            views = {v: 4 * n * b for v, n in zip(names, draws)}
            whole = sum(views.values())
            own = sum(views[v] for v in saved)
            unit.first_saved_bytes[b] = unit.first_saved_bytes.get(b, unit.saved_bytes[b]) + own  # (its views alone)
            unit.received_parts.setdefault(b, {})[X] = views
            unit.received_saved_parts.setdefault(b, {})
            unit.recomputed_shared_bytes.setdefault(b, {})[X] = whole
            if saves:
                unit.saved_bytes[b] += whole
                unit.shared_saved_bytes.setdefault(b, {})[X] = whole
                unit.received_saved_parts[b][X] = {v: views[v] for v in saved}
                if unit.split_backward:  # held after its input part too
                    held = unit.first_weight_held_bytes.get(b, unit.weight_held_bytes[b])
                    unit.first_weight_held_bytes[b] = held + own
                    unit.weight_held_bytes[b] += whole
                    if b in unit.weight_shared_bytes:
                        unit.weight_shared_bytes[b][X] = whole


def freeze(profile: Profile, units: Sequence[int]) -> None:
    """The units in `units` train no parameter (a LoRA model's norm and head): a zero-bubble stage ending
    in them holds, between its backward parts, only what its last trained unit holds timed alone and
    their own weight_held_bytes (planner.cost.ranges' trained[e])."""
    for l in units:
        profile.units[l].trainable_bytes = 0


def drop_saved(profile: Profile, units: Sequence[int], rng) -> None:
    """Of what each unit in `units` saves, some storages autograd frees as the forward returns (a gate
    whose argmax cuts the graph; UnitProfile.dropped_saved_bytes, planner.cost.ranges' x_l): a random part
    of what it shares with no neighbour, or all of it where it shares nothing (it attaches to no graph)."""
    for l in units:
        unit, whole = profile.units[l], rng.random() < 0.3
        for b in profile.micro_batch_sizes:
            own = _unshared(unit, b)
            if whole and own == unit.saved_bytes[b]:
                unit.dropped_saved_bytes[b] = {"": own}
            elif own > 0:
                unit.dropped_saved_bytes[b] = {"": int(own * rng.random()) // 4 * 4}  # whole elements


def share_kept(profile: Profile, cuts: Sequence[int], rng) -> None:
    """Units k - 1 and k both read a model input (gpt's tokens: the embedding saves them, the next
    unit reads their shape), for k in `cuts`: unit k - 1 saves it, and each keeps it when recomputed,
    with unit k's input across cut k (UnitProfile.recomputed_shared_bytes; planner.cost.ranges' r_k)."""
    for k in cuts:
        before, after = profile.units[k - 1], profile.units[k]
        draw = rng.randint(0, 1 << 19)
        for b in profile.micro_batch_sizes:
            size = min(draw * b, _unshared(before, b))
            if size <= 0:
                continue
            name = f"input{k}"
            before.shared_saved_bytes.setdefault(b, {})[name] = size
            for unit in (before, after):
                unit.input_bytes[b] = unit.input_bytes.get(b, 0) + size
                unit.recomputed_shared_bytes.setdefault(b, {})[name] = size
            crossing = before.shared_saved_bytes[b].get(f"cut{k}")
            if crossing:  # unit k keeps its input, which unit k - 1 saves too (d_k)
                after.recomputed_shared_bytes[b][f"cut{k}"] = crossing


def keep_read(profile: Profile, cuts: Sequence[int], rng) -> None:
    """Units k - 1 and k both read a value made before them (a gate, a position table: each layer reads
    it), for k in `cuts`: each keeps it when recomputed, and unit k - 1 does not save it, unit k saves
    it or not (UnitProfile.recomputed_shared_bytes, shared_saved_bytes; planner.cost.ranges' q_k, u_k:
    what the two hold once where both, or unit k - 1 alone, are recomputed)."""
    for k in cuts:
        before, after = profile.units[k - 1], profile.units[k]
        draw, saves = rng.randint(0, 1 << 19), rng.random() < 0.5
        for b in profile.micro_batch_sizes:
            size = min(draw * b, _unshared(after, b)) if saves else draw * b
            if size <= 0:
                continue
            name = f"read{k}"
            if saves:
                after.shared_saved_bytes.setdefault(b, {})[name] = size
            for unit in (before, after):
                unit.input_bytes[b] = unit.input_bytes.get(b, 0) + size
                unit.recomputed_shared_bytes.setdefault(b, {})[name] = size
            crossing = (before.shared_saved_bytes.get(b) or {}).get(f"cut{k}")
            if crossing:  # unit k keeps its input, which unit k - 1 saves too (d_k)
                after.recomputed_shared_bytes[b][f"cut{k}"] = crossing


def let_go(profile: Profile, cuts: Sequence[int], rng) -> None:
    """Unit k lets part of what it shares with unit k - 1 go in its input part, for k in `cuts` (a stage's
    last unit freeing a storage the unit before, inside the stage, still holds: UnitProfile.weight_shared_bytes,
    planner.cost.ranges' d'_k < d^h_k)."""
    for k in cuts:
        unit = profile.units[k]
        for b, shares in unit.shared_saved_bytes.items():
            unit.weight_shared_bytes[b] = {name: int(n * rng.random()) for name, n in shares.items()}


def compute_inside(profile: Profile, rng, share: float = 0.5) -> None:
    """Some units read values that earlier units (not the first) compute from their parameters: where a
    stage holds such a unit and the value's source, the unit holds more, or less, between its weight
    backward's parts (UnitProfile.inner_weight_bytes, planner.cost.inner_weight); one or two sources
    each, never taking more than the unit holds; each source keeps, alone, the gradient of an output it
    makes from its parameters (inner_seed_bytes), which a stage holding that value's last reader does not."""
    for k in range(2, profile.num_units):
        unit = profile.units[k]
        if rng.random() >= share or not unit.weight_held_bytes:
            continue
        sources = rng.sample(range(1, k), min(k - 1, rng.randint(1, 2)))
        for b, held in unit.weight_held_bytes.items():
            inner, kept = {}, {}
            for source in sorted(sources, reverse=True):  # what a stage starting at `source` holds: >= 0
                inner[str(source)] = rng.randint(-held // 2, held)
                kept[str(source)] = inner[str(source)] - rng.randint(0, held // 4)  # the rest: saved tensors
                held += inner[str(source)]
            unit.inner_weight_bytes[b] = inner
            if rng.random() < 0.8:  # else not measured: all of it counted as held
                unit.inner_kept_bytes[b] = kept
        for source in sources:  # the source's output, made from its parameters: its gradient kept alone
            maker, crossing = profile.units[source], profile.cut(source + 1).values[0]
            for b, kept in maker.weight_kept_bytes.items():
                maker.inner_seed_bytes[b] = {crossing.name: rng.randint(0, kept)}


def _unshared(unit, b: int) -> int:
    """What a unit saves at b that no value it shares or drops names (the room for another shared part: the
    profile's loader refuses more, planner.profile.unit_profile)."""
    shared, dropped = unit.shared_saved_bytes.get(b, {}), unit.dropped_saved_bytes.get(b, {})
    return unit.saved_bytes[b] - sum(max(shared.get(name, 0), dropped.get(name, 0))
                                     for name in set(shared) | set(dropped))


def share_saved(profile: Profile, cuts: Sequence[int]) -> None:
    """Units k - 1 and k both save the activation crossing cut k (a ReLU's output the next
    convolution saves), for k in `cuts`, as `planner profile` records it (shared_saved_bytes): at
    most what each unit saves, all its shares together."""
    for k in cuts:
        before, after = profile.units[k - 1], profile.units[k]
        for b in profile.micro_batch_sizes:
            size = min(profile.cut(k).activation_bytes(b), _unshared(before, b), _unshared(after, b))
            if size > 0:
                before.shared_saved_bytes.setdefault(b, {})[f"cut{k}"] = size
                after.shared_saved_bytes.setdefault(b, {})[f"cut{k}"] = size


def drawn_chain(draw, L: int) -> Profile:
    """A hypothesis-drawn profile of L units at b in (1, 2, 4) (`draw` of an st.composite): unit
    times, parameters, saved and cut bytes, the stage call cost and the optimizer steps all drawn."""
    from hypothesis import strategies as st

    unit = st.floats(1e-4, 4e-3)
    profile = synthetic_profile(
        forward=draw(st.lists(unit, min_size=L, max_size=L)),
        backward=draw(st.lists(unit, min_size=L, max_size=L)),
        params=draw(st.lists(st.integers(0, 5000), min_size=L, max_size=L)),
        saved=draw(st.lists(st.integers(0, 500), min_size=L, max_size=L)),
        cut_act=draw(st.lists(st.integers(0, 800), min_size=L - 1, max_size=L - 1)),
        sizes=(1, 2, 4),
        stage_overhead={b: (draw(st.sampled_from([0.0, 1e-4])), draw(st.sampled_from([0.0, 2e-4]))) for b in (1, 2, 4)})
    for u in profile.units:
        u.optimizer_s = {"sgd": draw(st.sampled_from([0.0, 1e-4])), "adamw": 3e-4}
    return profile
