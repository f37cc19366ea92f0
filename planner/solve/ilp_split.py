"""The split of one scenario as the integer program's variables (planner.solve.ilp builds the program
over them).

Split (staircase over S = p v stages): z[l][g] = 1 iff unit l is in a stage <= g, with

    z[l][S-1] = 1;  z[l][g] >= z[l+1][g] (contiguity);  z[l][g] <= z[l][g+1];  z[l][g] <= z[l+1][g+1]
    x[l][g] = z[l][g] - z[l][g-1]   (unit l in stage g)      e[k][g] = z[k-1][g] - z[k][g]   (cut k ends g)

and variables outside each unit's stage range (planner.solve.reach) fixed. Recomputation under
'auto' with a cap: rho[l][g] <= x[l][g]. Under a zero-bubble schedule a stage g > 0 starting at a cut
no gradient crosses splits its backward as the first stage does: whole_g = sum_k e[k][g-1] over those
cuts (`_whole_start`). The rows over these (planner.solve.ilp_ties, ilp_durations, ilp_memory) are
linear in them.
Times are in milliseconds and memory in MiB inside the model.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import pulp

from planner.cost.model import num_micro_batches, rank_caps
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.profile.profile import Profile
from planner.solve.chain_recompute import worth_recomputing

MS = 1e3  # seconds -> milliseconds
MIB = float(2 ** 20)  # bytes -> MiB


class NoSplit(Exception):
    """Fixed variables contradict each other: no split is left."""


def variable(prob: pulp.LpProblem, name: str, binary: bool = False, low: float = 0.0) -> pulp.LpVariable:
    high, cat = (1, pulp.LpInteger) if binary else (None, pulp.LpContinuous)
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3: variables attached to their problem
        return prob.add_variable(name, low, high, cat=cat)
    return pulp.LpVariable(name, low, high, cat=cat)


class SplitProgram:
    """The program's split variables for one scenario, and the helpers every row over them uses."""

    def __init__(self, profile: Profile, b: int, opts: CostOptions, low: Sequence[int], high: Sequence[int]):
        self.profile, self.b, self.opts = profile, b, opts
        self.costs = range_costs(profile, b, opts.optimizer)
        L, S, p = profile.num_units, opts.num_stages, opts.pipeline_ranks
        self.L, self.S, self.p = L, S, p
        self.m = num_micro_batches(opts, b)
        self.low, self.high = list(low), list(high)
        self.prob = pulp.LpProblem("pipeline_plan", pulp.LpMinimize)
        self.z = [[self._z(l, g) for g in range(S)] for l in range(L)]
        self._staircase()
        self._recompute_vars()

    def _z(self, l: int, g: int):
        if g >= self.high[l] or g == self.S - 1:
            return 1
        if g < self.low[l]:
            return 0
        return variable(self.prob, f"z_{l}_{g}", binary=True)

    def add(self, constraint, name: str) -> None:
        if isinstance(constraint, pulp.LpConstraint) and len(constraint) > 0:
            self.prob.addConstraint(constraint, name)
        elif (isinstance(constraint, bool) and not constraint) or \
                (isinstance(constraint, pulp.LpConstraint) and not constraint.valid(1e-9)):
            raise NoSplit(name)

    def _staircase(self) -> None:
        z, L, S = self.z, self.L, self.S
        for l in range(L):
            for g in range(S):
                if l + 1 < L:
                    self.add(z[l][g] >= z[l + 1][g], f"contiguous_{l}_{g}")
                if g + 1 < S:
                    self.add(z[l][g] <= z[l][g + 1], f"prefix_{l}_{g}")
                if l + 1 < L and g + 1 < S:
                    self.add(z[l][g] <= z[l + 1][g + 1], f"nonempty_{l}_{g}")

    def x(self, l: int, g: int):
        return self.z[l][g] - (self.z[l][g - 1] if g > 0 else 0)

    def may(self, l: int, g: int) -> bool:
        return self.low[l] <= g <= self.high[l]

    def ends(self, k: int, g: int):
        """1 iff cut k ends stage g (unit k - 1 in g, unit k in g + 1)."""
        return self.z[k - 1][g] - self.z[k][g]

    def cut_may_end(self, k: int, g: int) -> bool:
        return self.may(k - 1, g) and self.may(k, g + 1)

    def _recompute_vars(self) -> None:
        c, opts = self.costs, self.opts
        self.rho: Dict[Tuple[int, int], pulp.LpVariable] = {}
        self._products: Dict[str, pulp.LpVariable] = {}  # the memory rows' products of binaries, by name
        self._exact: set = set()  # of them, those bounded by each factor too (MemoryRows._product)
        if opts.recompute != "auto" or all(cap is None for cap in rank_caps(opts, self.profile)):
            return
        useful = worth_recomputing(c, opts.schedule)
        for l in range(self.L):
            if useful[l]:
                for g in range(self.low[l], self.high[l] + 1):
                    self.rho[l, g] = variable(self.prob, f"r_{l}_{g}", binary=True)
                    self.add(self.rho[l, g] <= self.x(l, g), f"recompute_in_stage_{l}_{g}")

    def _define(self, name: str, expression) -> pulp.LpVariable:
        v = variable(self.prob, name)
        self.add(v == expression, f"define_{name}")
        return v

    def _whole_start(self, g: int):
        """1 iff stage g > 0 starts at a cut no value with a gradient crosses (planner.cost.ranges' `whole`:
        its split backward is the first stage's), a sum of e[k][g - 1]; None where no such cut may start it."""
        cuts = [k for k in range(1, self.L) if self.costs.whole[k] and self.cut_may_end(k, g - 1)]
        return pulp.lpSum(self.ends(k, g - 1) for k in cuts) if cuts else None

