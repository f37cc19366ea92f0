"""The integer program's rows for tied weights (planner.solve.ilp; planner.cost.ties: one copy of a
tied weight per rank):

    tau_t = sum_n y[t][n] tie(bytes_t, n d),   sum_n y[t][n] = 1,   sum_n n y[t][n] = sum_i h[t][i],
    h[t][i] >= x[u][g] for each use u of tied weight t and stage g on rank i,  h[t][i] <= k[t][i]
    k[t][i] = sum_{u, g on i} x[u][g] (t's uses on rank i),   q[t][i] = h[t][i] y[t][1] (i holds t alone)
    R_i -= sum_t ar_t (k[t][i] - q[t][i]),  O_i -= sum_t o_t / sigma_i (k[t][i] - h[t][i]), static bytes of
    rank i -= sum_t (beta^w + beta^t) c_t (k[t][i] - h[t][i]): one copy c_t of a tied weight per rank
    (planner.cost.ties; beta^w c_t and no tau_t, R_i, O_i terms for a frozen one; under local SGD the
    exchange takes off k - h); + (W_t - C_t) whole[t][i] where rank i keeps its copy whole under ZeRO
    (W_t, C_t: a copy's static bytes unsharded and sharded; `tie_whole`); w_i >= q[t][i] for the ties, and
    not for a unit whose exchange is its ties' alone. Under ZeRO-3 (d > 1) with two[t][i] = [k[t][i] >= 2]
    (binary: (n_t - 1) two >= k - h >= two): R_i += (N_t - ar_t) a[t][i], a = q two (a trainable tie
    on rank i alone, kept whole: all-reduced once a step, N_t, not sharded), and R_i -= two[t][i]
    sum_{u, g on i} gz_u x[u][g] for a frozen one (its gathers gz_u, none when kept whole), each
    product linearised exactly (`_kept_whole_exchange`)

(R_i, O_i: planner.solve.ilp_durations; the static bytes: planner.solve.ilp_memory.)
"""
from __future__ import annotations

from typing import Dict, Tuple

import pulp

from planner.cost.model import sync_time, tie_time, whole_reduce_time
from planner.cost.ties import tie_copies, tied_weights
from planner.solve.ilp_split import MS, SplitProgram, variable


class TieRows(SplitProgram):
    """The tied weights' holders, copies and all-reduce over the split; what the duration and memory rows
    take off or add for them."""

    def _ties(self) -> None:
        """h[t][i]: tied weight t has a use on rank i (k[t][i] of them); tau_t its all-reduce
        (one-hot y over holder counts); q[t][i] = h[t][i] y[t][1]: rank i is t's only holder."""
        opts, S, c = self.opts, self.S, self.costs
        self.hold: Dict[Tuple[str, int], object] = {}
        self.uses: Dict[Tuple[str, int], object] = {}
        self.alone: Dict[Tuple[str, int], object] = {}
        weights = tied_weights(self.profile)
        self.copies = tie_copies(weights, c)
        self.ties = [tie for tie in self.copies if tie.trainable]  # exchanged and stepped: trainable ones
        self.twice: Dict[Tuple[str, int], object] = {}  # [k[t][i] >= 2] under `parameters`
        for name, uses, size, trainable in weights:  # held once per rank: frozen ones too
            ranks = sorted({opts.rank_of_stage(g) for u in uses for g in range(S) if self.may(u, g)})
            for i in ranks:
                h = variable(self.prob, f"hold_{name}_{i}")
                self.add(h <= 1, f"hold_cap_{name}_{i}")
                k = pulp.lpSum(self.x(u, g) for u in uses for g in opts.stages_on(i) if self.may(u, g))
                for u in uses:
                    for g in opts.stages_on(i):
                        if self.may(u, g):
                            self.add(h >= self.x(u, g), f"hold_{name}_{i}_{u}_{g}")
                self.add(h <= k, f"hold_only_{name}_{i}")  # with h >= each use: h = [k >= 1]
                self.hold[name, i], self.uses[name, i] = h, k
                if opts.shard == "parameters" and len(uses) >= 2:  # two = [k - h >= 1] = [k >= 2]
                    two = variable(self.prob, f"twice_{name}_{i}", binary=True)
                    self.add((len(uses) - 1) * two >= k - h, f"twice_{name}_{i}")
                    self.add(two <= k - h, f"twice_only_{name}_{i}")
                    self.twice[name, i] = two
            if not trainable:  # no gradient: no all-reduce
                continue
            counts = range(1, min(len(uses), len(ranks)) + 1)
            y = {n: variable(self.prob, f"holders_{name}_{n}", binary=True) for n in counts}
            self.add(pulp.lpSum(y.values()) == 1, f"holders_one_{name}")
            self.add(pulp.lpSum(n * v for n, v in y.items()) == pulp.lpSum(self.hold[name, i] for i in ranks),
                     f"holders_count_{name}")
            for i in ranks:
                q = variable(self.prob, f"alone_{name}_{i}")
                self.add(q <= self.hold[name, i], f"alone_holds_{name}_{i}")
                self.add(q <= y[1], f"alone_one_{name}_{i}")
                self.add(q >= self.hold[name, i] + y[1] - 1, f"alone_both_{name}_{i}")
                self.alone[name, i] = q
            self.term[("tie", name)] = self._define(
                f"tie_{name}", pulp.lpSum(tie_time(size, n * opts.tie_replicas, opts) * MS * v for n, v in y.items()))

    def _kept_whole_exchange(self, i: int, per_copy: Dict[str, float]):
        """What ZeRO-3 keeping a tie whole on rank i changes in its exchange (planner.cost.ties), in ms:
        a trainable tie on rank i alone with two uses there (a = q [k >= 2]) is all-reduced whole
        once a step instead of sharded, N - Z per copy; a frozen one with two uses there (twice) is
        gathered for none of them: each use's gathers come off, twice * sum_u Z_u x_u (`frozen_whole`)."""
        opts, dtype, out = self.opts, self.profile.dtype, 0
        if opts.shard != "parameters" or opts.local_sgd or opts.data_parallel <= 1:
            return out
        for tie in self.copies:
            if (tie.name, i) not in self.twice:
                continue
            two = self.twice[tie.name, i]
            if tie.trainable:
                whole = whole_reduce_time(tie.bytes_, opts, dtype, i) * MS - per_copy[tie.name]
                a = variable(self.prob, f"alone_twice_{tie.name}_{i}")
                q = self.alone[tie.name, i]
                self.add(a <= q, f"alone_twice_q_{tie.name}_{i}")
                self.add(a <= two, f"alone_twice_two_{tie.name}_{i}")
                self.add(a >= q + two - 1, f"alone_twice_both_{tie.name}_{i}")
                out += whole * a
                continue
            gathers = [(sync_time(tie.bytes_, 0.0, again, opts, dtype, self.m, rank=i) * MS, u)
                       for u, again in zip(tie.uses, tie.regathered)]
            here = pulp.lpSum(z * self.x(u, g) for z, u in gathers for g in opts.stages_on(i) if self.may(u, g) and z)
            most = sum(z for z, _ in gathers)
            if most <= 0:
                continue
            saved = variable(self.prob, f"frozen_whole_{tie.name}_{i}")  # = twice * here, exactly
            self.add(saved <= here, f"frozen_whole_here_{tie.name}_{i}")
            self.add(saved <= most * two, f"frozen_whole_twice_{tie.name}_{i}")
            self.add(saved >= here - most * (1 - two), f"frozen_whole_both_{tie.name}_{i}")
            out -= saved
        return out

    def _rest_moves(self) -> Dict[int, bool]:
        """Per unit using a tie: whether anything but its ties' copies moves in its exchange (what
        the placement's latency rows ask of a tie's units)."""
        c, out = self.costs, {}
        for l in {u for tie in self.ties for u in tie.uses}:
            own = sum(tie.bytes_ for tie in self.ties if l in tie.uses)
            out[l] = sync_time(c.p[l] - own, c.t[l] - own, c.fb[l], self.opts, self.profile.dtype, self.m,
                               buffer_bytes=c.buf[l]) > 0
        return out

    def tie_held(self, tie, i: int):
        """Copies of `tie` the per-unit sums of rank i count beyond the one it holds: k - h."""
        if (tie.name, i) not in self.hold:
            return 0
        return self.uses[tie.name, i] - self.hold[tie.name, i]

    def tie_exchanged(self, tie, i: int):
        """Copies of `tie` rank i does not exchange in its buckets: k - q (all k when it spans ranks);
        under local SGD k - h (the averaging covers the copy it holds)."""
        if (tie.name, i) not in self.hold:
            return 0
        if self.opts.local_sgd:
            return self.tie_held(tie, i)
        return self.uses[tie.name, i] - self.alone[tie.name, i]

    def tie_whole(self, tie, i: int, shard: str):
        """1 where rank i keeps its copy of `tie` whole (planner.cost.ties.kept_whole): under `gradients`
        h - q (held, spanning ranks); under `parameters` at least that (a trainable tie) and at least
        [k >= 2] (`twice`, a binary the uses force), which the memory rows never want larger."""
        if (tie.name, i) not in self.hold or shard not in ("gradients", "parameters"):
            return 0
        spans = self.hold[tie.name, i] - self.alone[tie.name, i] if tie.trainable else 0
        if shard == "gradients":
            return spans
        whole = variable(self.prob, f"whole_{tie.name}_{i}")
        if tie.trainable:
            self.add(whole >= spans, f"whole_spans_{tie.name}_{i}")
        if (tie.name, i) in self.twice:
            self.add(whole >= self.twice[tie.name, i], f"whole_twice_{tie.name}_{i}")
        return whole
