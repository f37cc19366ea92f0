"""The `planner` command: subcommands live in planner/cli/*.py, each with a `register(sub)`."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from planner.cli import compare, export, fidelity, import_, profile, show, solve
from planner.errors import CaptureError, OneLineParser, UsageError, run_subcommand
from planner.jsonio import JsonFileError

SUBCOMMANDS = [profile, solve, compare, show, export, import_, fidelity]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="planner", description="Plan pipeline-parallel training of a PyTorch model.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # ValueError: what the cost model, solvers and profile readers raise on inputs they cannot take
    # (spec.ModelEntryError is one); nothing here loads torch, so that a bad option fails at once
    return run_subcommand(args, (UsageError, JsonFileError, CaptureError, ValueError),
                          "interrupted; nothing was written")


if __name__ == "__main__":
    sys.exit(main())
