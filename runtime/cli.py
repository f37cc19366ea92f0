"""`runtime execute PLAN` and `runtime show PLAN`."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Optional

from planner.jsonio import JsonFileError, read_json, write_json_atomic
from runtime import schedule as sched

PLAN_SCHEMA_VERSION = 1
_REQUIRED = ("model", "schedule", "micro_batch_size", "num_micro_batches", "global_batch", "stages")


class UsageError(ValueError):
    pass


def load_plan(path: str) -> Dict[str, Any]:
    plan = read_json(path, what="plan")
    if not isinstance(plan, dict) or plan.get("kind", "plan") != "plan":
        raise JsonFileError(f"{path!r} is not a plan file; make one with `planner solve PROFILE`")
    if plan.get("schema_version") != PLAN_SCHEMA_VERSION:
        raise JsonFileError(f"plan schema_version {plan.get('schema_version')!r} is not supported "
                            f"(expected {PLAN_SCHEMA_VERSION}); re-run `planner solve`")
    missing = [k for k in _REQUIRED if k not in plan]
    if missing:
        raise JsonFileError(f"plan {path!r} lacks {', '.join(missing)}; re-run `planner solve`")
    return plan


def check_plan(plan: Dict[str, Any]) -> List[List[sched.Action]]:
    """Everything that can be checked before starting a process."""
    g, b, m = int(plan["global_batch"]), int(plan["micro_batch_size"]), int(plan["num_micro_batches"])
    if b * m != g:
        raise UsageError(f"the plan's global batch {g} is not micro-batch size {b} x {m} micro-batches")
    lists = sched.build_schedule(plan["schedule"], len(plan["stages"]), m)
    sched.check_schedule(lists, m)
    return lists


def _merge_states(out_dir: str, world: int, path: str) -> None:
    import torch

    state: Dict[str, Any] = {}
    for rank in range(world):
        state.update(torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=True))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def execute(args: argparse.Namespace) -> int:
    from runtime.launch import launch_local
    from runtime.report import build_report, format_report

    plan = load_plan(args.plan)
    check_plan(plan)
    if args.steps < 1:
        raise UsageError("--steps must be at least 1")
    world = len(plan["stages"])
    threads = args.threads or int(plan.get("profile", {}).get("threads", 1) or 1)
    print(f"running {args.plan}: {world} stages, {plan['schedule']}, micro-batch {plan['micro_batch_size']} x "
          f"{plan['num_micro_batches']}, {args.steps} steps, {threads} thread(s) per rank", flush=True)
    out_dir = tempfile.mkdtemp(prefix="runtime-")
    worker_args = [os.path.abspath(args.plan), "--out-dir", out_dir, "--steps", str(args.steps),
                   "--lr", str(args.lr), "--threads", str(threads)]
    if args.save_state:
        worker_args.append("--save-state")
    result = launch_local(world, worker_args, out_dir, threads, args.timeout, progress_rank=world - 1)
    if not result.ok:
        print(f"error: rank {result.failed_rank} failed: {result.error}\n"
              f"(its log: {result.log_path}; all ranks were stopped)", file=sys.stderr)
        return 1
    ranks = [read_json(os.path.join(out_dir, f"rank{r}.json")) for r in range(world)]
    report = build_report(plan, ranks)
    print(format_report(report))
    if args.save_state:
        _merge_states(out_dir, world, args.save_state)
        print(f"saved the trained model's state_dict to {args.save_state}")
    if args.report:
        write_json_atomic(args.report, report)
        print(f"wrote report {args.report}")
    shutil.rmtree(out_dir, ignore_errors=True)
    return 0


def show(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    lists = check_plan(plan)
    for s, actions in enumerate(lists):
        units = plan["stages"][s]["units"]
        print(f"rank {s} ({units[0]} .. {units[-1]}), at most {sched.max_in_flight(actions)} micro-batches held:")
        print("  " + " ".join(str(a) for a in actions))
    print("checked: every send has its receive, and no rank can wait forever")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runtime", description="Execute a pipeline-parallel plan.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("execute", help="run a plan: one process per stage on this machine")
    ex.add_argument("plan", help="plan JSON from `planner solve`")
    ex.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    ex.add_argument("--lr", type=float, default=0.01, help="SGD learning rate, no momentum (default 0.01)")
    ex.add_argument("--save-state", metavar="PATH", help="write the trained model's full state_dict here")
    ex.add_argument("--report", metavar="PATH", help="write the measured-vs-predicted report JSON here")
    ex.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: as profiled)")
    ex.add_argument("--timeout", type=float, default=120.0,
                    help="seconds a rank may wait on another before giving up (default 120)")
    ex.set_defaults(func=execute)
    sh = sub.add_parser("show", help="print and check each rank's instruction list")
    sh.add_argument("plan")
    sh.set_defaults(func=show)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (JsonFileError, UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
