"""`planner show PLAN`: the plan's table again, and optionally a PNG of per-stage time and memory bars."""
from __future__ import annotations

import argparse

from planner.errors import UsageError
from planner.jsonio import atomic_path, check_writable, image_format
from planner.plan.file import Plan, load_plan


def draw_plan(plan: Plan, path: str) -> None:
    """Two bar charts: per-stage compute / transfer time (ms), and memory (MiB) against the cap
    (replicated stages: labelled with their replica count, memory per replica device)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = plan.stages
    x = list(range(len(stages)))
    compute = [(st.forward_s + st.backward_s) * 1e3 for st in stages]
    transfer = [st.comm_s * 1e3 for st in stages]
    mib = float(2 ** 20)
    static = [(st.memory_bytes["params"] + st.memory_bytes["grads"] + st.memory_bytes["optimizer"]) / mib
              for st in stages]
    acts = [st.memory_bytes["activations"] / mib for st in stages]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.5 * len(stages) + 3), 6), sharex=True)
    top.bar(x, compute, label="compute")
    top.bar(x, transfer, bottom=compute, label="transfer")
    top.set_ylabel("ms per micro-batch")
    top.legend()
    top.set_title(f"{plan.schedule}, b={plan.micro_batch_size} x m={plan.num_micro_batches}, "
                  f"predicted {plan.predicted_iteration_s * 1e3:.1f} ms")
    bottom.bar(x, static, label="params+grads+optimizer")
    bottom.bar(x, acts, bottom=static, label="activations")
    caps = [st.memory_cap_bytes or plan.memory_per_device_bytes for st in stages]
    if any(caps):
        bottom.step([i - 0.5 for i in x] + [len(x) - 0.5], [c / mib if c else 0 for c in caps] + [caps[-1] / mib if caps[-1] else 0],
                    where="post", color="red", label="cap")
    replicas = [st.replica_count for st in stages]
    bottom.set_ylabel("MiB" + (" per replica device" if max(replicas) > 1 else ""))
    bottom.set_xlabel("stage" + (" (x replicas)" if max(replicas) > 1 else ""))
    if max(replicas) > 1:
        bottom.set_xticks(x)
        bottom.set_xticklabels([f"{i} x{r}" if r > 1 else str(i) for i, r in zip(x, replicas)])
    bottom.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=image_format(path, "--png"))
    plt.close(fig)


def cmd_show(args: argparse.Namespace) -> int:
    from planner.plan.table import format_plan_table

    if args.png:  # before the work: a picture over the plan read lost it
        check_writable(args.png, [args.plan])
        image_format(args.png, "--png")
    plan = load_plan(args.plan)
    print(format_plan_table(plan))
    if args.png:
        try:
            draw_plan(plan, args.png)
        except ImportError:
            raise UsageError("--png needs matplotlib: pip install matplotlib") from None
        print(f"wrote {args.png}")
    return 0


def register(sub) -> None:
    s = sub.add_parser("show", help="print a plan's table; --png draws per-stage time and memory bars")
    s.add_argument("plan", help="plan JSON from `planner solve`")
    s.add_argument("--png", default=None, help="write a bar chart of per-stage time and memory here")
    s.set_defaults(func=cmd_show)
