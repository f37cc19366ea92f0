"""What a range of units costs: the one place stage costs come from (the cost model and every solver).

For a micro-batch size b, with L units and prefix sums over them, a stage holding units [a, e)
run at speed sigma costs per micro-batch

    forward(a, e)  = (k^f + sum_{a<=l<e} f_l) / sigma
    backward(a, e) = (k^b + sum_{a<=l<e} g_l + sum_{l in R, a<=l<e} f_l) / sigma      (R: recomputed)
    saved(a, e)    = sum_{a<=l<e} (in_l if l in R else s_l)       bytes held for backward
                     - sum_{a<k<e} o_k                            (what both neighbours hold, once)
                     + [a not in R] first_a                       (its first unit's inputs as received)
                     - gap(a, e)                                  (what two units that are not neighbours hold, once)
    o_k            = d_k, p_k, u_k or q_k as neither of units k - 1, k is in R, only k, only k - 1, both
    gap(a, e)      = sum x over (l, j, x): a <= l, j < e, none of l .. j in R   (`gaps`: shared_storage)
    params(a, e)   = sum_{a<=l<e} P_l                              parameter bytes
    trainable(a, e) = sum_{a<=l<e} T_l                             of them, those that train (T_l <= P_l)
    step(a, e)     = sum_{a<=l<e} o_l / sigma                      one optimizer step over them

Zero-bubble schedules split the backward in two parts (planner.profile.splitgrad). A later stage
(a > 0: gradients flow into its inputs) runs autograd towards its inputs first, then once per
parameter group from what that kept; a recomputed forward runs in both parts (the weight part reads
what the recomputed region saved again, planner.pipeline.zerobubble):

    backward_input(a, e)  = (k^i + sum gi_l + sum_{l in R} f_l) / sigma
    backward_weight(a, e) = (k^w + sum gw_l + walk(a, e) + sum_{l in R} f_l) / sigma
    walk(a, e)            = sum_{a<=j<k<e} nu_j omega_k
    weight_held(a, e)     = sum_{a<=l<e-1} ((in^h_l if l in R else s_l - x_l) + k_l) + (in^h'_{e-1} + k_{e-1}
                            if e-1 in R else h_{e-1}) - sum_{a<k<e} o^h_k   bytes held from the first to the second
                            + [a not in R] first'_a + [a < e-1; e-1 not in R] (o^h_{e-1} - o'_{e-1})
                            + inner(a, e)        (values it computes from its parameters: planner.cost.inner_weight)

(k_l: the gradients unit l keeps for its weight part. After the input part autograd still holds
every node below the stage's topmost frontier, so each unit but the last holds all it saved; the
last one what it held timed alone, h_l; a recomputed one its input and its kept gradients. Where
the stage ends in units that train no parameter (a LoRA model's norm and head), the topmost frontier
is in t = trained[e], its last unit with a trained parameter: with a <= t < e - 1 and none of
t .. e - 1 recomputed, the units before t count as above, t holds h_t (less d^h_t - d'_t where t > a,
first'_a where t = a) and each unit after it its own h_l (what it saved went with the graph above the
frontier), no d^h_k counted for k > t; otherwise (a recomputed unit among them, or no trained unit in
the stage) the count above, an over-count. The solvers' stage rows add the difference at the cut the
stage ends at where the stage holds t (planner.cost.stage_memory's trained_end). A
profile without k_l: sum (in'_l if l in R else h_l). in'_l = in_l but for the model's last unit, whose
input part ran the loss's backward: what the loss saved is freed by then.)

The first stage (a = 0) has no input that needs a gradient: its input part only finds that out,
and its weight part is one whole backward, so everything saved is held until it runs, and so is
the gradient its outputs received. So has any stage whose cut a carries no value that requires a
gradient (everything before it frozen; integer or detached inputs: no CutValue.requires_grad at cut
a; the runtime's engine then has no input to differentiate, planner.profile.splitgrad.backward_input):
with such an a (`whole[a]`, whole[0] true),

    backward_input(a, e)  = k^0 / sigma
    backward_weight(a, e) = backward(a, e)
    weight_held(a, e)     = held_saved(a, e) + grad(e)     (the gradient received for its outputs too)
    held_saved(a, e)      = saved(a, e) with s_l - x_l, in^h_l, o^h_k for s_l, in_l, o_k

x_l: of s_l, what autograd frees as the forward returns, its outputs held (UnitProfile.dropped_saved_bytes):
saved by a node no output's graph reaches (a routed layer's gate saves its input and argmax cuts the
graph). The ranks count it as saved (the live kind's s_l) but not as held between the parts. A unit all
of whose saves go so (or that saves nothing: frozen weights, no input needing a gradient) attaches to no
graph, so recomputed its checkpoint's kept inputs go too: in^h_l (in^h'_l) is in_l (in'_l) but for such a
unit, which keeps only what the loss saved (nothing), and r^h_k is r_k but 0 for it. d^h_k: of d_k, the
storages both units still hold as the forward returns (d_k less the shares either drops).

Each of the weight part's calls (omega_k of unit k: its parameter groups) walks the whole graph below
its frontier (torch's engine finds what leads to the parameters from everything below its roots), so
it pays for the nodes of the stage's earlier units too: nu_j = w N_j, N_j unit j's autograd nodes and
w the seconds per node per call (Profile.weight_walk_s; 0 where not measured). Quadratic in a
stage's units: a unit's walk within itself is in gw_l, timed alone.

gi_l, gw_l, h_l: the unit's profiled parts, timed alone with gradients flowing into its inputs;
k^i, k^w: what a later stage's split pays once on top of them, k^0: the first stage's input part
(Profile.split_overhead_s; each includes the engine's backward cost where the whole backward's
k^b does). A profile without the parts (older files) gets gw_l = WEIGHT_SHARE g_l,
gi_l = g_l - gw_l (a matmul's weight gradient costs what its input gradient does) and h_l = s_l
(everything saved held until the weight part: an upper bound); one without split_overhead_s gets
k^i = k^b, k^w = 0 and k^0 = the engine's backward cost.

first_a: what unit a saves beyond s_a when it starts a stage (UnitProfile.first_saved_bytes): a rank
receives each input in a storage of its own, a broadcast view materialised, where inside a stage two
inputs may share one or be views of a larger one (0 for most units). first'_a: the same in weight_held,
first_a where the unit counts s_a + k_a, first_weight_held_bytes - h_a where it counts h_a (the
stage's only unit, or a profile without k_l).

d_k, d^h_k, d'_k, r_k, the recomputed neighbours' p_k, u_k, q_k (o^h_k, o'_k) and the non-neighbours' gaps:
planner.cost.shared_storage, where each is defined; a stage starting where it receives views of one storage
apart counts them, s_l and h_l as it receives them (planner.cost.received: `at`). A stage [a, e) without
recomputation: saved(a, e) = sum_{a<=l<e} (s_l - d_l) + d_a, a prefix and a term of its start (`saved_prefix`,
`saved_at_start`).

(k^f, k^b: the profile's per-stage call cost at b; in_l: activation bytes crossing cut l (in_0 = 0)
and the bytes of the model's inputs unit l reads, each storage once (views of one storage inside a stage;
apart where a stage starts: shared_storage.kept_inputs), and for the last unit the bytes the loss saves (the
loss runs on the stage's output, outside a recomputation: its input and target stay held);
o_l: the profiled optimizer step of unit l.) Cut k's messages: act(k) bytes forward, grad(k)
bytes of gradients backward; a message of n bytes over a link (bandwidth, latency) takes
latency + n / bandwidth. Arrays are numpy so that solvers read whole matrices at once.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Tuple

import numpy as np

from planner.cost.inner_weight import inner_held, inner_pairs
from planner.cost.received import saved_correction, views as received_views
from planner.cost.shared_storage import never_recomputed, storage_terms
from planner.profile.profile import Profile

WEIGHT_SHARE = 0.5  # of a unit's backward, its weight part, where the profile did not time the parts


def prefix_sums(values) -> np.ndarray:
    """[0, v_0, v_0 + v_1, ...]: the sum over units [a, e) is prefix[e] - prefix[a]."""
    return np.concatenate([[0.0], np.cumsum(np.asarray(list(values), dtype=float))])


def range_matrix(prefix: np.ndarray) -> np.ndarray:
    """M[a, e] = prefix[e] - prefix[a] for every range a < e (+inf elsewhere)."""
    n = prefix.shape[0]
    out = prefix[None, :] - prefix[:, None]
    return np.where(np.triu(np.ones((n, n), dtype=bool), k=1), out, np.inf)


class RangeCosts:
    """Prefix sums of one profile at one micro-batch size (speed 1; divide times by sigma)."""

    def __init__(self, profile: Profile, b: int, optimizer: str = "sgd"):
        units, self.num_units, self.b = profile.units, len(profile.units), b
        self.call_forward, self.call_backward = profile.stage_overhead(b)
        engine = profile.engine_overhead_s[1]
        first_input, later_input, later_weight = profile.split_overhead_s.get(
            b, (0.0, self.call_backward - engine, 0.0))
        # k^0, k^i, k^w (module docstring): the engine's backward cost is charged to the input part
        self.first_input, self.later_input, self.later_weight = first_input + engine, later_input + engine, later_weight
        self.first_call = self.call_backward - engine  # the first stage's weight part: one whole backward call
        self.f = np.array([u.forward_s[b] for u in units], dtype=float)
        self.g = np.array([u.backward_s[b] for u in units], dtype=float)
        self.s = np.array([u.saved_bytes[b] for u in units], dtype=float)
        self.gw = np.array([u.backward_weight_s[b] if u.split_backward else WEIGHT_SHARE * u.backward_s[b]
                            for u in units], dtype=float)
        self.gi = np.array([u.backward_input_s[b] if u.split_backward else u.backward_s[b] - self.gw[l]
                            for l, u in enumerate(units)], dtype=float)
        self.h = np.array([u.weight_held_bytes[b] if u.split_backward else u.saved_bytes[b] for u in units], float)
        # a stage's first unit gets its inputs each in a storage of its own (UnitProfile.first_saved_bytes):
        # what it then saves (holds until its weight part) beyond what it does inside a stage
        self.first = np.array([u.first_saved_bytes.get(b, u.saved_bytes[b]) - u.saved_bytes[b] for u in units],
                              dtype=float)
        self.first_held = np.array([u.first_weight_held_bytes.get(b, self.h[l]) - self.h[l] if u.split_backward
                                    else self.first[l] for l, u in enumerate(units)], dtype=float)
        # walk(a, e) = WALK[e] - WALK[a] - NU[a] (OMEGA[e] - OMEGA[a]), WALK[e] = sum_{k<e} omega_k NU[k]
        walk = profile.weight_walk_s.get(b, 0.0)
        self.nu = np.array([walk * u.weight_walk_nodes for u in units], dtype=float)
        self.omega = np.array([u.weight_calls for u in units], dtype=float)
        self.NU, self.OMEGA = prefix_sums(self.nu), prefix_sums(self.omega)
        self.WALK = prefix_sums(self.omega * self.NU[:-1])
        # k_l: of h_l, the gradients kept for the weight part; known: the later stages' weight_held
        # below (each unit but the last holds all it saved, as the graph below the top frontier lives)
        self.kept_known = all(u.split_backward and b in u.weight_kept_bytes for u in units)
        # trained[e], e = 0 .. L: the last unit before cut e with a parameter that trains (-1: none). After a
        # later stage's input part autograd frees the graph above its topmost frontier: the units after it
        # (frozen) and what that unit saved above its own frontier (module docstring)
        self.trained = np.full(self.num_units + 1, -1, dtype=int)
        for e in range(1, self.num_units + 1):
            self.trained[e] = e - 1 if units[e - 1].trainable_bytes > 0 else self.trained[e - 1]
        self.k = np.array([u.weight_kept_bytes.get(b, 0) for u in units], dtype=float)
        self.inner = inner_pairs(units, b, [[v.name for v in c.values] for c in profile.cuts])  # (inner_weight)
        self.p = np.array([u.param_bytes for u in units], dtype=float)
        self.t = np.array([u.trainable_bytes for u in units], dtype=float)  # of p, those that train
        name = "adamw" if optimizer in ("adam", "adamw") else optimizer
        self.o = np.array([float(u.optimizer_s.get(name, 0.0)) for u in units], dtype=float)
        cuts = [profile.cut(k) for k in range(1, self.num_units)]
        # whole[a]: a stage starting at unit a receives no value that requires a gradient (the first
        # stage, or one after frozen units / behind integer or detached inputs), so its split backward
        # is the first stage's: an empty input part and one whole backward as its weight part (module
        # docstring); whole[L] false (no stage starts there)
        self.whole = np.array([True] + [not any(v.kind == "tensor" and v.requires_grad for v in c.values)
                                        for c in cuts] + [False], dtype=bool)
        # act[k], grad[k]: bytes crossing cut k, k = 0 .. L (0 at both ends: nothing crosses them)
        self.act = np.array([0.0] + [c.activation_bytes(b) for c in cuts] + [0.0], dtype=float)
        self.grad = np.array([0.0] + [c.gradient_bytes(b) for c in cuts] + [0.0], dtype=float)
        # what a recomputed unit l keeps where it starts a stage, its inputs as received: the activations
        # crossing cut l and the model's inputs it reads; the last unit also what the loss saves (it runs after
        # the stage, outside the recomputation). in_l, in'_l (inputs, weight_inputs: inside a stage, each storage
        # once; of them, what a later stage's recomputed unit holds after its input part, which ran the loss's
        # backward), d_k, x_l, d^h_k, d'_k, r_k, in^h_l, in^h'_l, the shares o_k of neighbours and the gaps of
        # units apart: planner.cost.shared_storage.storage_terms
        self.loss_saved = loss_saved = np.array([u.loss_saved_bytes.get(b, 0) for u in units], dtype=float)
        self.received_inputs = self.act[:-1] + np.array([u.input_bytes.get(b, 0) for u in units], float) + loss_saved
        vars(self).update(storage_terms(units, b, self.s, self.received_inputs, loss_saved))
        self.F, self.G, self.S, self.P, self.O = (prefix_sums(x) for x in (self.f, self.g, self.s, self.p, self.o))
        self.T = prefix_sums(self.t)
        # floating-point buffer bytes (local SGD averages them too; 0 where the profile has none)
        self.buf = np.array([u.buffer_bytes or 0 for u in units], dtype=float)
        self.BUF = prefix_sums(self.buf)
        # of a unit's frozen bytes, those its backward needs (gathered again for it under ZeRO-3): the
        # backward runs where the unit trains or its input cut carries a gradient (runtime.shard_params).
        # The input cut, not what the unit's nodes read: the runtime's unit segments take in and hand on
        # every value crossing their cut, so a gradient-carrying skip that passes a frozen unit by is
        # one of its outputs, and FSDP2's pre-backward hook on it gathers the unit (measured:
        # tests/runtime/test_shard_params.py, frozen_tied_lm's `side` unit)
        self.runs = (self.t > 0) | (self.grad[:-1] > 0)
        self.fb = np.where(self.runs, self.p - self.t, 0.0)
        self.FB = prefix_sums(self.fb)
        # ZeRO-3's collectives per micro-batch of each unit (runtime.shard_params: one FSDP2 unit per
        # plan unit): a unit holding parameters gathers them for its forward and again for its
        # backward where that runs, and reduce-scatters its gradients where it trains
        self.collectives = (self.p > 0) * (1.0 + self.runs) + (self.t > 0)
        self.COLL = prefix_sums(self.collectives)
        # {a: RangeCosts}: the storage terms a stage starting at cut a sees, where it receives a storage apart
        # (planner.cost.received); every per-range count of such a stage reads them (`at`)
        self.views = received_views(self, profile)
        never_recomputed(self)  # recomputable, again (f where recomputed), AGAIN; the others never recomputed

    def at(self, a: int) -> "RangeCosts":
        """The costs a stage starting at unit a sees: its view where it receives a storage apart, else these."""
        return self.views.get(a, self)

    # --- one range -------------------------------------------------------------------------
    def forward(self, a: int, e: int, speed: float = 1.0) -> float:
        return float(self.call_forward + self.F[e] - self.F[a]) / speed

    def backward(self, a: int, e: int, speed: float = 1.0, recompute: Iterable[int] = ()) -> float:
        redo = sum(float(self.again[l]) for l in recompute if a <= l < e)
        return float(self.call_backward + self.G[e] - self.G[a] + redo) / speed

    def backward_input(self, a: int, e: int, speed: float = 1.0, recompute: Iterable[int] = ()) -> float:
        if self.whole[a]:
            return self.first_input / speed
        redo = sum(float(self.again[l]) for l in recompute if a <= l < e)
        return float(self.later_input + self.gi[a:e].sum() + redo) / speed

    def backward_weight(self, a: int, e: int, speed: float = 1.0, recompute: Iterable[int] = ()) -> float:
        redo = sum(float(self.again[l]) for l in recompute if a <= l < e)
        if self.whole[a]:
            return float(self.first_call + self.G[e] - self.G[a] + redo) / speed
        return float(self.later_weight + self.gw[a:e].sum() + self.walk(a, e) + redo) / speed

    def walk(self, a: int, e: int) -> float:
        """Seconds a later stage [a, e)'s weight calls walk through its earlier units (module docstring)."""
        return float(self.WALK[e] - self.WALK[a] - self.NU[a] * (self.OMEGA[e] - self.OMEGA[a]))

    def walk_matrix(self) -> np.ndarray:
        """walk(a, e) for every range a < e (0 elsewhere)."""
        valid = np.triu(np.ones((self.num_units + 1,) * 2, dtype=bool), k=1)
        walk = (self.WALK[None, :] - self.WALK[:, None]) - self.NU[:, None] * (self.OMEGA[None, :] - self.OMEGA[:, None])
        return np.where(valid, walk, 0.0)

    def weight_held(self, a: int, e: int, recompute: Iterable[int] = ()) -> float:
        if a in self.views:
            return self.views[a].weight_held(a, e, recompute)
        if self.whole[a]:
            return self.held_saved(a, e, recompute) + float(self.grad[e])
        redo = set(recompute)
        if not self.kept_known:
            first = inner_held(self.inner, a, e, redo) + (0.0 if a in redo else float(self.first_held[a]))
            return first + float(sum(float(self.held_weight_inputs[l]) if l in redo else float(self.h[l])
                                     for l in range(a, e)))
        # the unit holding its h: the stage's last, or, where the stage ends in frozen units, its last
        # trained one (none of it and them recomputed); those after it hold theirs (what they saved went
        # with the graph above the topmost frontier)
        top = int(self.trained[e])
        last = top if a <= top < e - 1 and not any(l in redo for l in range(top, e)) else e - 1
        first = 0.0 if a in redo else float(self.first_held[a] if last == a else self.first[a])
        held = sum(float(self.held_weight_inputs[l] if l in redo else self.s[l] - self.dropped[l]) + float(self.k[l])
                   for l in range(a, last))
        held += float(self.held_weight_inputs[last] + self.k[last]) if last in redo else float(self.h[last:e].sum())
        # its h: of what it shares with the unit before, only what it still holds
        before = int(last - 1 in redo)
        lost = float(self.held_shares[last, before, 0] - self.weight_shares[last, before]) \
            if last > a and last not in redo else 0.0
        inner = inner_held(self.inner, a, e, redo)
        return first + held - self._shared_once(a, last + 1, redo, held=True) + lost + inner

    def split_matrices(self, again) -> Tuple[np.ndarray, np.ndarray]:
        """(backward_input, backward_weight) over every range [a, e) at speed 1 (+inf where e <= a),
        `again` the prefix sums of the recomputed forwards (0: none)."""
        whole = range_matrix(self.G + again)[self.whole] + self.first_call
        backward_input = range_matrix(prefix_sums(self.gi) + again) + self.later_input
        backward_weight = range_matrix(prefix_sums(self.gw) + again) + self.later_weight + self.walk_matrix()
        backward_input[self.whole] = np.where(np.isfinite(whole), self.first_input, np.inf)
        backward_weight[self.whole] = whole
        return backward_input, backward_weight

    def saved(self, a: int, e: int, recompute: Iterable[int] = ()) -> float:
        if a in self.views:
            return self.views[a].saved(a, e, recompute)
        redo = set(recompute)
        swap = sum(float(self.inputs[l] - self.s[l]) for l in redo if a <= l < e)
        first = 0.0 if a in redo else float(self.first[a])
        return float(self.S[e] - self.S[a]) + first + swap - self._shared_once(a, e, redo) - self.gap(a, e, redo)

    def held_saved(self, a: int, e: int, recompute: Iterable[int] = ()) -> float:
        """Of `saved`, what autograd still holds as the forward returns: less x_l, a recomputed unit
        attached to no graph holding none of its inputs (module docstring)."""
        if a in self.views:
            return self.views[a].held_saved(a, e, recompute)
        redo = set(recompute)
        first = 0.0 if a in redo else float(self.first[a])
        held = sum(float(self.held_inputs[l]) if l in redo else float(self.s[l] - self.dropped[l])
                   for l in range(a, e))
        return held + first - self._shared_once(a, e, redo, held=True) - self.gap(a, e, redo, held=True)

    def gap(self, a: int, e: int, recompute: Iterable[int] = (), held: bool = False) -> float:
        """What units [a, e) count twice of the storages two of them save that are not neighbours, no unit between
        saving it: gap(a, e) = sum of (l, j, x) in `gaps` with a <= l, j < e, none of l .. j recomputed
        (planner.cost.shared_storage); with `held`, `held_gaps`."""
        redo = set(recompute)
        return float(sum(x for l, j, x in (self.held_gaps if held else self.gaps)
                         if a <= l and j < e and not any(m in redo for m in range(l, j + 1))))

    def gap_matrix(self, held: bool = False) -> np.ndarray:
        """gap(a, e) over every cell [a, e], nothing recomputed (0 where it holds no pair)."""
        # each pair adds x to every cell a <= l, e >= j + 1: placed at (l, j + 1), summed over a from the
        # bottom and over e from the left (O(L^2) however many pairs)
        out = np.zeros((self.num_units + 1,) * 2)
        for l, j, x in (self.held_gaps if held else self.gaps):
            out[l, j + 1] += x
        return np.cumsum(np.cumsum(out[::-1], axis=0)[::-1], axis=1)

    def _shared_once(self, a: int, e: int, redo, held: bool = False) -> float:
        """What units [a, e) count twice of the storages neighbours share: o_k for each cut k inside the
        range, d_k, p_k, u_k or q_k as neither unit, the one after, the one before or both are recomputed
        (planner.cost.shared_storage); with `held`, of them what both still hold as the forward returns (o^h_k)."""
        table = self.held_shares if held else self.shares
        return float(sum(table[k, int(k - 1 in redo), int(k in redo)] for k in range(a + 1, e)))

    def params(self, a: int, e: int) -> float:
        return float(self.P[e] - self.P[a])

    def trainable(self, a: int, e: int) -> float:
        return float(self.T[e] - self.T[a])

    def buffers(self, a: int, e: int) -> float:
        """Floating-point buffer bytes of units [a, e) (`buf`)."""
        return float(self.BUF[e] - self.BUF[a])

    def frozen_backward(self, a: int, e: int) -> float:
        """Frozen bytes of units [a, e) whose backward runs (`fb`)."""
        return float(self.FB[e] - self.FB[a])

    def sharded_collectives(self, a: int, e: int) -> float:
        """ZeRO-3's gathers and reduce-scatters per micro-batch of units [a, e) (`collectives`)."""
        return float(self.COLL[e] - self.COLL[a])

    def step(self, a: int, e: int, speed: float = 1.0) -> float:
        return float(self.O[e] - self.O[a]) / speed

    def message_s(self, k: int, link: Tuple[float, float], gradient: bool = False) -> float:
        """Seconds of cut k's activation (or gradient) message over link (bandwidth, latency); 0 if empty."""
        size = float(self.grad[k] if gradient else self.act[k])
        bandwidth, latency = link
        return latency + size / bandwidth if size > 0 else 0.0

    # --- matrices over all ranges [a, e) (+inf where e <= a) ------------------------------------
    def matrix(self, prefix: np.ndarray) -> np.ndarray:
        return range_matrix(prefix)

    def work_prefix(self, recompute_all: bool = False) -> np.ndarray:
        """Prefix sums of f + g per unit (plus f again when every unit is recomputed: `again`)."""
        return self.F + self.G + (self.AGAIN if recompute_all else 0.0)

    def saved_prefix(self, recompute_all: bool = False) -> np.ndarray:
        """Prefix sums of the bytes each unit holds for backward (its input when recomputed; less
        what it shares with the unit before): saved(a, e) = prefix[e] - prefix[a] + saved_at_start[a]
        - gap_matrix()[a, e] (the last where not every unit is recomputed)."""
        return prefix_sums(self.inputs - self.shares[:, 1, 1]) if recompute_all else prefix_sums(self.s - self.dup)

    def saved_at_start(self, recompute_all: bool = False) -> np.ndarray:
        """[a], a = 0 .. L: what a stage starting at unit a adds to `saved_prefix`'s difference (d_a:
        its first unit shares nothing inside it; and first_a: its inputs arrive in storages of their own)."""
        return np.append(self.shares[:, 1, 1], 0.0) if recompute_all else np.append(self.dup + self.first, 0.0)

    def saved_matrix(self, recompute_all: bool = False) -> np.ndarray:
        """saved(a, e) over every range [a, e) (+inf where e <= a), every unit recomputed or none."""
        saved = range_matrix(self.saved_prefix(recompute_all)) + self.saved_at_start(recompute_all)[:, None]
        correction = self.saved_correction(recompute_all)
        return saved if correction is None else saved + correction

    def saved_correction(self, recompute_all: bool = False) -> Optional[np.ndarray]:
        """saved_matrix less its prefix form, 0 where e <= a; None where 0 (planner.cost.received)."""
        return saved_correction(self, recompute_all)


_CACHE: "OrderedDict[tuple, Tuple[Profile, RangeCosts]]" = OrderedDict()


def range_costs(profile: Profile, b: int, optimizer: str = "sgd") -> RangeCosts:
    """RangeCosts of (profile, b), built once per profile object (profiles are not changed in place)."""
    key = (id(profile), b, optimizer)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is profile:
        _CACHE.move_to_end(key)
        return hit[1]
    costs = RangeCosts(profile, b, optimizer)
    _CACHE[key] = (profile, costs)
    while len(_CACHE) > 64:
        _CACHE.popitem(last=False)
    return costs
