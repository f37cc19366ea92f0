"""The Lagrangian dual of the path forms' bound (planner.solve.branch): weights on the forms whose
combination's best split is as slow as possible.

Every form is a constant plus per-stage terms, form_k(split) = c_k + sum_g C_kg . t_g(a_g, e_g)
(t_g: stage g's duration terms over its range, C_kg: the form's counts of them). For weights
lam >= 0 with sum 1, every split satisfies

    step(split) >= max_k form_k(split) >= sum_k lam_k form_k(split) = lam.c + sum_g (lam.C_g) . t_g(a_g, e_g)

whose least value over the allowed splits, h(lam), is one dynamic program over (stage, first unit)
(planner.solve.floors.form_completions): a bound of every allowed split. h is concave; at a vertex
lam = e_k it is form k's own best split, so its maximum (the dual) is at least the largest of those. The maximum is found by
cutting planes (Kelley): the splits found so far, s_1..s_n, give the model
min_j lam.f(s_j) >= h(lam); the next lam maximises the model (a small linear program: the weights
and one level), and the dynamic program there gives h(lam) and the split s_{n+1} attaining it (its
form values: one more cut). The first step is the best single form's vertex, so the result is
never below that form's bound. It stops when the model's maximum and the best h agree within
DUAL_TOL, when a split repeats (the model is exact there), when h reaches the caller's goal, or at
the deadline or step limit. Each split found is handed to the caller (simulated: a candidate plan,
and its longest path a new form, a new column of the program).
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

import numpy as np

from planner.solve.backends import quiet_stdout, refused_to_start
from planner.solve.floors import form_completions, split_of

try:
    import highspy
except ImportError:  # a core dependency; without it the search keeps the single forms' bound
    highspy = None

DUAL_TOL = 1e-4  # relative: the model's maximum this close to the best h ends the ascent


class Dual:
    """The cutting-plane ascent, with the splits found kept across calls (a warm start when the forms
    or the allowed stages change). `forms`: planner.solve.forms.Forms (constant, coefficients
    [g, k, term], completion, terms.rows, terms.allowed; forms are only ever appended)."""

    def __init__(self):
        self.splits: List[Tuple[int, ...]] = []  # stage ends e_0 .. e_{S-1} = L
        self.stage_terms: List[np.ndarray] = []  # t_g of each split: (S, terms)
        self.values = np.zeros((0, 0))  # [split, form]: form_k(split)
        self.master: Optional[SimplexMaster] = None

    def ascend(self, forms, found: Callable[[Tuple[int, ...]], None], deadline: float,
               iterations: int, goal: Callable[[], float] = lambda: np.inf) -> Tuple[Optional[np.ndarray], float]:
        """(lam, h(lam)) for the best weights found over the forms known (None, -inf without forms);
        `found(ends)` is called with each new split attaining some h (it may add forms); it stops
        early once h reaches goal() (nothing faster than the incumbent is left to prove)."""
        terms = forms.terms
        self._keep_allowed(terms)
        if not len(forms) or highspy is None:
            return None, -np.inf
        start = int(np.argmax(forms.constant + forms.completion[:, 0, 0]))  # the best single form
        best, best_h = None, -np.inf
        for it in range(iterations):
            self._extend(forms)
            if it == 0 or not self.splits:
                lam, model = np.eye(len(forms))[start], np.inf
            else:
                lam, model = self.master.solve()
                if lam is None:  # the program failed: keep the best found
                    break
            per_stage = np.einsum("k,gkt->gt", lam, forms.coefficients)
            D, ends = form_completions(per_stage[:, None, :], terms.band, with_ends=True)
            h = float(lam @ forms.constant + D[0, 0, 0])
            if h > best_h:
                best, best_h = lam, h
            if not np.isfinite(h) or model - best_h <= DUAL_TOL * abs(best_h) or best_h >= goal() or \
                    time.perf_counter() > deadline:
                break
            split = split_of(ends[0])
            if split in self.splits:  # the model is exact at lam: lam is the best over these forms
                if it > 0:
                    break
                continue
            self._add(forms, split)
            found(split)
        if best is not None:  # forms learned since it was found weigh 0
            best = np.r_[best, np.zeros(len(forms) - len(best))]
        return best, best_h

    def _extend(self, forms) -> None:
        """Columns for the forms learned since the last call: their values at every split kept."""
        n, K = self.values.shape
        if len(forms) == K:
            return
        new = slice(K, len(forms))
        columns = forms.constant[new][None, :] + (
            np.einsum("gkt,ngt->nk", forms.coefficients[:, new], np.stack(self.stage_terms)) if n else
            np.zeros((0, len(forms) - K)))
        self.values = np.concatenate([self.values, columns], axis=1)
        if self.master is None:
            self.master = SimplexMaster()
        for k in range(K, len(forms)):
            self.master.add_form(self.values[:, k])

    def _add(self, forms, split: Tuple[int, ...]) -> None:
        a, rows = 0, []
        for g, e in enumerate(split):
            rows.append(forms.terms.rows[g][:, a, e])
            a = e
        stage_terms = np.stack(rows)
        value = forms.constant + np.einsum("gkt,gt->k", forms.coefficients, stage_terms)
        self.splits.append(split)
        self.stage_terms.append(stage_terms)
        self.values = np.concatenate([self.values, value[None, :]])
        self.master.add_split(value)

    def _keep_allowed(self, terms) -> None:
        """Drop the splits through a stage no longer allowed (their cuts would hold the model down)."""
        keep = [all(terms.allowed[g][a, e] for g, (a, e) in enumerate(zip((0,) + split[:-1], split)))
                for split in self.splits]
        if all(keep):
            return
        self.splits = [s for s, k in zip(self.splits, keep) if k]
        self.stage_terms = [t for t, k in zip(self.stage_terms, keep) if k]
        self.values = self.values[np.array(keep, dtype=bool)]
        self.master = SimplexMaster()
        for k in range(self.values.shape[1]):
            self.master.add_form(np.zeros(0))
        for value in self.values:
            self.master.add_split(value)


class SimplexMaster:
    """max over lam in the simplex of min_j lam.values[j] as a linear program kept in HiGHS (column 0
    the level t, then one weight per form; row 0: sum lam = 1, then t - lam.values[j] <= 0 per split),
    re-solved warm as splits (rows) and forms (columns) are added."""

    def __init__(self):
        with quiet_stdout():  # highspy prints a banner on stdout when a model is created
            self.solver = highspy.Highs()
        self.solver.setOptionValue("output_flag", False)
        self.solver.setOptionValue("threads", 1)
        inf = highspy.kHighsInf
        self.solver.addCol(-1.0, -inf, inf, 0, np.zeros(0, dtype=np.int32), np.zeros(0))  # maximise t
        self.solver.addRow(1.0, 1.0, 0, np.zeros(0, dtype=np.int32), np.zeros(0))
        self.forms, self.splits = 0, 0

    def add_form(self, values: np.ndarray) -> None:
        """A weight lam_k; values: form k at every split so far."""
        index = np.arange(len(values) + 1, dtype=np.int32)
        self.solver.addCol(0.0, 0.0, 1.0, len(index), index, np.r_[1.0, -values])
        self.forms += 1

    def add_split(self, values: np.ndarray) -> None:
        """A cut t <= lam.values; values: every form at the split."""
        index = np.arange(self.forms + 1, dtype=np.int32)
        self.solver.addRow(-highspy.kHighsInf, 0.0, len(index), index, np.r_[1.0, -values])
        self.splits += 1

    def solve(self) -> Tuple[Optional[np.ndarray], float]:
        self.solver.run()
        if refused_to_start(self.solver):
            self.solver.run()
        if self.solver.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None, np.inf
        solution = np.asarray(self.solver.getSolution().col_value)
        lam = np.clip(solution[1:], 0.0, None)
        return lam / lam.sum(), float(solution[0])
