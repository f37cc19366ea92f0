"""`planner export PLAN --format torchtitan|torch`: the plan as torchtitan's job config or a
torch.distributed.pipelining script (planner/plan/export.py)."""
from __future__ import annotations

import argparse
import sys

from planner.errors import UsageError
from planner.jsonio import atomic_path, check_writable
from planner.plan.export import FORMATS, export_refusal, torch_snippet, torchtitan_config
from planner.plan.file import load_plan


def cmd_export(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    if args.output:
        check_writable(args.output, [args.plan])
    refusal = export_refusal(plan)
    if refusal:
        raise UsageError(refusal)
    text = (torchtitan_config if args.format == "torchtitan" else torch_snippet)(plan, args.plan)
    if args.output:
        with atomic_path(args.output) as tmp:
            with open(tmp, "w") as f:
                f.write(text)
        print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def register(sub) -> None:
    s = sub.add_parser("export", help="print the plan as torchtitan's pipeline config or a torch.distributed."
                                      "pipelining script")
    s.add_argument("plan", help="plan JSON from `planner solve`")
    s.add_argument("--format", choices=FORMATS, required=True,
                   help="torchtitan: its [parallelism]/[training] TOML; torch: a Python script building the stages")
    s.add_argument("-o", "--output", default=None, help="write here instead of printing")
    s.set_defaults(func=cmd_export)
