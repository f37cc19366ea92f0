"""`planner import-pipedream graph.txt`: PipeDream's published profiles as this project's profiles."""
from __future__ import annotations

import argparse

from planner.errors import UsageError
from planner.jsonio import check_writable


def cmd_import(args: argparse.Namespace) -> int:
    from planner.profile.pipedream import import_pipedream
    from planner.profile.profile import save_profile

    check_writable(args.output, [args.graph])
    try:
        profile = import_pipedream(args.graph, args.batch_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    save_profile(profile, args.output)
    crossing = max((len(c.values) for c in profile.cuts), default=0)
    print(f"{profile.num_units} units (at most {crossing} tensors crossing a cut), micro-batch size "
          f"{args.batch_size}; wrote {args.output}")
    return 0


def register(sub) -> None:
    s = sub.add_parser("import-pipedream", help="convert a PipeDream graph.txt profile",
                       description="One unit per node in topological order; times ms -> s; Input nodes free.")
    s.add_argument("graph", help="PipeDream graph.txt")
    s.add_argument("--batch-size", type=int, required=True, help="the minibatch size the graph was profiled at")
    s.add_argument("--output", "-o", required=True, help="profile JSON to write")
    s.set_defaults(func=cmd_import)
