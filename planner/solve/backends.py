"""Running the MIP backends: CBC (pulp's bundled binary, bound parsed from its log) and HiGHS (highspy).

HiGHS is the default (its objective cutoff prunes against the chain solver's incumbent; pulp
deprecates its bundled CBC) and highspy a core dependency; where it cannot be imported anyway, the
default falls back to CBC with a one-line note (`choose_backend`), so a plain install solves
everything.

Never trust pulp's status word: CBC stopped by its time limit is reported "Optimal" by pulp. Both
runners return (proven optimal, best bound in model units or None, solver ran); optimality needs
sol_status Optimal *and* CBC's own 'Result - Optimal' line (CBC) or HiGHS's model status.
"""
from __future__ import annotations

import contextlib
import math
import os
import pickle
import re
import select
import signal
import sys
import tempfile
import time
import warnings
from typing import Iterator, Optional, Tuple

import pulp


BACKENDS = ("highs", "cbc")
DEFAULT_BACKEND = "highs"
HIGHS_MISSING = ("highspy cannot be imported here (it comes with pipeplanner: reinstall, or pip install highspy), "
                 "so the integer program runs on CBC, pulp's bundled solver, which is slower")


def highs_available() -> bool:
    """pulp found highspy when it was imported (pulp decides once, at import)."""
    return bool(pulp.HiGHS(msg=False).available())


def choose_backend(requested: Optional[str] = None) -> Tuple[str, Optional[str]]:
    """(backend, note): `requested`, or by default HiGHS where highspy imports and otherwise CBC with
    a note saying so. ValueError for an unknown backend, or HiGHS asked for by name without highspy."""
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"unknown ILP backend {requested!r}; use 'cbc' or 'highs'")
    if highs_available() or requested == "cbc":
        return requested or DEFAULT_BACKEND, None
    if requested == "highs":
        raise ValueError("the highs backend needs highspy, which cannot be imported here: pip install highspy, "
                         "or use --backend cbc")
    return "cbc", f"note: {HIGHS_MISSING}"


_CBC_BOUND = re.compile(r"^Lower bound:\s*(\S+)", re.M)
_CBC_OBJECTIVE = re.compile(r"^Objective value:\s*(\S+)", re.M)


def _parse_cbc_log(text: str) -> Tuple[Optional[str], Optional[float], Optional[float]]:
    """(result line, objective, lower bound) from a CBC log; the bound is rounded down to be safe.

    CBC prints 'Result - Optimal solution found' (no 'Lower bound' line: bound = objective) or
    'Result - Stopped on time limit' followed by 'Objective value:', 'Lower bound:', 'Gap:'. The
    bound is printed with few decimals, so half a unit of the last printed digit is subtracted.
    """
    result = re.search(r"^Result - (.*)$", text, re.M)
    if result is None and re.search(r"^Optimal - objective value", text, re.M):
        lp = re.search(r"^Optimal - objective value\s*(\S+)", text, re.M)
        try:  # a pure LP (every integer variable fixed): CBC's simplex proved it optimal
            return "Optimal solution found", float(lp.group(1)), None
        except ValueError:
            return "Optimal solution found", None, None
    objective = _CBC_OBJECTIVE.search(text)
    bound = _CBC_BOUND.search(text)
    value = None
    if bound:
        try:
            value = float(bound.group(1))
            digits = bound.group(1).split(".")[1] if "." in bound.group(1) else ""
            if "e" not in bound.group(1).lower():
                value -= 0.5 * 10.0 ** (-len(digits))
        except ValueError:
            value = None
    obj = None
    if objective:
        try:
            obj = float(objective.group(1))
        except ValueError:
            obj = None
    return (result.group(1).strip() if result else None), obj, value


CBC_ATTEMPTS = 3  # the bundled CBC 2.10.3 sometimes segfaults when its time limit strikes mid-phase


def _run_cbc(prob: pulp.LpProblem, time_limit: Optional[float], warm: bool, gap: float = 1e-10
             ) -> Tuple[bool, Optional[float], bool]:
    """Solve with CBC; (proven optimal, best bound in model units or None, solver ran).

    A crashed run (pulp raises PulpSolverError) is retried with 1.5x the time limit, since the
    crash depends on where the limit interrupts the solver; after CBC_ATTEMPTS crashes the
    third element is False and the caller falls back to the warm start.
    """
    limit = time_limit
    for _ in range(CBC_ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="planner-cbc-") as scratch:
            log_path = os.path.join(scratch, "cbc.log")
            with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC; it is what we ship with
                warnings.simplefilter("ignore", DeprecationWarning)
                solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, logPath=log_path, gapRel=gap,
                                           warmStart=warm)
            solver.tmpDir = scratch  # MPS/solution files land here and go away even after a crash
            try:
                prob.solve(solver)
            except pulp.PulpSolverError:
                limit = None if limit is None else limit * 1.5
                continue
            with open(log_path, "r", encoding="utf-8", errors="replace") as f:
                result, objective, bound = _parse_cbc_log(f.read())
        optimal = prob.sol_status == pulp.LpSolutionOptimal and result is not None and result.startswith("Optimal")
        if optimal and bound is None:
            bound = objective  # CBC proved optimality: its bound is its objective
        return optimal, bound, True
    return False, None, False


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null for the duration (C libraries write there directly)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _run_highs(prob: pulp.LpProblem, time_limit: Optional[float], cutoff: Optional[float] = None,
               gap: float = 1e-10) -> Tuple[bool, Optional[float], bool]:
    """`_run_highs_here` in a forked child, stopped past its time limit (then: not ran). HiGHS 1.16
    can loop at the root after a restart with an objective bound, past its time limit and deaf to its
    interrupt callbacks (BENCHMARKS.md, "HiGHS past its time limit"); only a process of its own can be
    stopped. The child's variable values and status are copied back into `prob`."""
    if time_limit is None or not sys.platform.startswith("linux"):  # macOS: libraries unsafe after a fork
        return _run_highs_here(prob, time_limit, cutoff, gap)
    sys.stdout.flush()  # else the child, flushing what it inherited, would print the parent's lines again
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: solve, send the outcome, leave without running the parent's exit handlers
        code = 1
        try:
            os.close(read_end)
            try:
                result = _run_highs_here(prob, time_limit, cutoff, gap)
                values = {v.name: v.varValue for v in prob.variables()}
                outcome = ("solved", result, prob.status, prob.sol_status, values)
            except Exception as e:  # noqa: BLE001 - raised again in the parent, as in-process
                outcome = ("raised", f"{type(e).__name__}: {e}")
            with os.fdopen(write_end, "wb") as out:
                out.write(pickle.dumps(outcome))  # our own process: no user file
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + time_limit + max(HIGHS_GRACE_S, HIGHS_GRACE_SHARE * time_limit)
    chunks = []
    with os.fdopen(read_end, "rb") as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return False, None, False
            chunk = os.read(pipe.fileno(), 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if status != 0 or not chunks:
        return False, None, False
    outcome = pickle.loads(b"".join(chunks))
    if outcome[0] == "raised":
        raise RuntimeError(f"HiGHS failed: {outcome[1]}")
    _, result, prob.status, prob.sol_status, values = outcome
    for v in prob.variables():
        v.varValue = values.get(v.name)
    return result


def refused_to_start(model) -> bool:
    """Whether a HiGHS model's run did not start; its thread scheduler is then ours for the next run.
    HiGHS keeps one scheduler per process: where another user of HiGHS in it (pulp's HiGHS at its default
    threads) started it with more threads, a run asking for one is refused, and read as solved it gave a
    bound of 0."""
    import highspy

    if model.getModelStatus() != highspy.HighsModelStatus.kNotset:
        return False
    highspy.Highs.resetThreadScheduler(False)
    return True


HIGHS_GRACE_S, HIGHS_GRACE_SHARE = 2.0, 0.5  # past its time limit, a HiGHS child is stopped after this


def _run_highs_here(prob: pulp.LpProblem, time_limit: Optional[float], cutoff: Optional[float] = None,
                    gap: float = 1e-10) -> Tuple[bool, Optional[float], bool]:
    """Solve with HiGHS through highspy; (proven optimal, MIP dual bound in model units or None, True).

    One thread (the machine is shared). Feasibility tolerances are 1e-9 rather than 1e-7: a memory
    row in MiB over by one byte (1e-6 MiB) must not pass. cutoff (model units, without the
    objective's constant): HiGHS's objective_bound, pruning every node that cannot beat it; when
    nothing beats it, the problem is marked infeasible and the cutoff is the proven bound. Where
    HiGHS ends in its own solve error, CBC solves the program instead.
    """
    params = dict(mip_feasibility_tolerance=1e-9, primal_feasibility_tolerance=1e-9)
    if cutoff is not None and math.isfinite(cutoff):
        params["objective_bound"] = float(cutoff)
    solver = pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=gap, gapAbs=1e-9, threads=1, **params)
    if not solver.available():  # choose_backend never picks highs then
        raise RuntimeError("the highs backend needs highspy: pip install highspy, or use the cbc backend")
    import highspy
    try:
        with quiet_stdout():  # highspy prints a banner on stdout when a model is created
            prob.solve(solver)
            if refused_to_start(prob.solverModel):
                prob.solve(solver)
    except pulp.PulpSolverError:
        return False, None, False
    info = prob.solverModel.getInfo()
    status = prob.solverModel.getModelStatus()
    if status == highspy.HighsModelStatus.kNotset:  # it did not run: no answer, not a bound of 0
        return False, None, False
    if status == highspy.HighsModelStatus.kSolveError:
        # HiGHS doubts its own optimum at these tolerances (a row off by 1.00001e-9 against 1e-9) and
        # returns no solution, which read as "no plan" where one fits: CBC solves the same program
        return _run_cbc(prob, time_limit, warm=False, gap=gap)
    has_solution = int(getattr(info, "primal_solution_status", 0)) == 2  # kSolutionStatusFeasible
    if "objective_bound" in params and not has_solution and status in (
            highspy.HighsModelStatus.kObjectiveBound, highspy.HighsModelStatus.kInfeasible):
        prob.status, prob.sol_status = pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
        return True, float(cutoff), True
    bound = float(getattr(info, "mip_dual_bound", float("nan")))
    optimal = prob.sol_status == pulp.LpSolutionOptimal and status == highspy.HighsModelStatus.kOptimal
    if optimal:  # proven within gapRel; a pure LP (all integers fixed) reports no MIP bound
        objective = float(getattr(info, "objective_function_value", float("nan")))
        if math.isfinite(objective):
            proven = objective - abs(objective) * max(gap, 1e-9)
            bound = proven if not math.isfinite(bound) else max(bound, proven)
    if "objective_bound" in params and math.isfinite(bound):
        bound = min(bound, float(cutoff))  # nodes were pruned against the cutoff: only this much is proven
    return optimal, (bound if math.isfinite(bound) else None), True
