"""`planner compare PROFILE`: the ILP beside the baselines other tools use, all by the same cost model."""
from __future__ import annotations

import argparse
import math

from planner.errors import UsageError


def cmd_compare(args: argparse.Namespace) -> int:
    from planner.cli.solve import check_plan_flags, ilp_backend, problem_from_args, solve_problem
    from planner.solve.diagnose import InfeasibleError, NoPlanInTime
    from planner.solve.solution import OPTIMALITY_GAP

    profile, opts, devices, schedules, topology = problem_from_args(args)
    check_plan_flags(args, opts, devices, topology)
    backend = ilp_backend(args.backend)
    try:
        best = solve_problem(profile, opts, devices, schedules, topology, args, "ilp", backend)
    except InfeasibleError as e:
        best = None
        print(f"ilp: infeasible: {str(e).splitlines()[0]}")
    except NoPlanInTime as e:
        best = None
        print(f"ilp: {e}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    rows = [("method", "iteration ms", "bottleneck ms", "max memory MiB", "feasible", "b x m", "vs ilp")]
    results = [("ilp", best)] + [(m, _baseline(profile, opts, devices, schedules, topology, args, m))
                                 for m in ("uniform", "params", "block")]
    if args.replicate:
        replicated = _replicated_or_none(profile, opts, devices, schedules, args)
        label = "replicas" if replicated is None else \
            "replicas " + "/".join(str(st.replicas) for st in replicated.cost.stages)  # r_g per stage
        results.append((label, replicated))
    for name, sol in results:
        if sol is None:
            rows.append((name, "-", "-", "-", "no", "-", "-"))
            continue
        cost = sol.cost
        ratio = f"{sol.objective / best.objective:.3f}x" if best is not None and best.objective > 0 else "-"
        rows.append((name, f"{sol.objective * 1e3:.3f}", f"{cost.bottleneck_s * 1e3:.3f}",
                     f"{max(cost.device_memory) / 2 ** 20:.1f}", "yes" if cost.feasible else "no",
                     f"{sol.micro_batch_size} x {sol.num_micro_batches}", ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if best is not None:
        gap = 0.0 if math.isnan(best.gap) else best.gap
        asked = f" (within the {100 * best.requested_gap:.2f}% asked for)" \
            if best.requested_gap > OPTIMALITY_GAP and gap <= best.requested_gap else ""
        # what the plan recomputes: its stages' lists, not the solver's (which, under --recompute all, names
        # units whose backward needs nothing: planner.cost.shared_storage.never_recomputed)
        recomputed = sum(len(st.recompute) for st in best.cost.stages)
        print(f"ilp: {best.status}, gap {100 * gap:.2f}%{asked}, schedule {best.cost.schedule}, "
              f"p {best.cost.pipeline_ranks} x d {best.cost.data_parallel}, "
              f"{recomputed} units recomputed [{best.seconds:.2f} s]")
    return 0


def _baseline(profile, opts, devices, schedules, topology, args: argparse.Namespace, method: str):
    """A baseline's plan for the problem planner solve plans: its split over the same scenarios (every
    placement on a --topology), with H chosen by the same rule under --local-sgd-max; the fastest
    infeasible plan where none fits (its row says so), None where it has no plan at all."""
    from planner.solve.baselines import solve_baseline
    from planner.solve.localsgd import solve_local_sgd
    from planner.solve.placed import topology_scenarios
    from planner.solve.search import expand_scenarios

    n, v = profile.num_units, args.virtual_stages

    def run(options, scenario: bool):  # scenario: on these options' own p, d, schedule and v
        if topology is not None:
            scenarios = topology_scenarios(options, topology, n, args.stages, schedules, v)
        else:
            scenarios = [options] if scenario else expand_scenarios(options, n, devices, schedules, v)
        found = solve_baseline(profile, scenarios, method)
        if found is None:
            raise _NoPlan()
        return found

    try:
        if args.local_sgd_max > 1:
            return solve_local_sgd(profile, opts, args.local_sgd_max, args.sync_overhead, run)
        return run(opts, False)
    except _NoPlan:
        return None


class _NoPlan(Exception):
    """A baseline without a single scenario to split."""


def _replicated_or_none(profile, opts, devices, schedules, args):
    """The --replicate optimum (planner solve --replicate), or None when no replicated plan fits."""
    from planner.cli.solve import solve_replicated_from_args
    from planner.solve.diagnose import InfeasibleError, NoPlanInTime

    try:
        return solve_replicated_from_args(profile, opts, devices, schedules, args)
    except InfeasibleError as e:
        print(f"replicas: infeasible: {str(e).splitlines()[0]}")
        return None
    except NoPlanInTime as e:
        print(f"replicas: {e}")
        return None
    except (UsageError, ValueError) as e:  # the other rows are solved: say why this one is not
        print(f"replicas: not available: {str(e).splitlines()[0]}")
        return None


def register(sub) -> None:
    from planner.cli.solve import add_problem_options
    s = sub.add_parser("compare", help="the ILP plan beside the uniform / params / block baselines",
                       description="Predicted iteration time, bottleneck, peak memory and feasibility of the "
                                   "optimal plan and of DeepSpeed's and torchgpipe's partitioners, by one cost model.")
    add_problem_options(s)
    s.add_argument("--replicate", action="store_true",
                   help="add a row for the optimum with replicated stages (planner solve --replicate): "
                        "--stages N devices shared by at most N stages")
    s.set_defaults(func=cmd_compare)
