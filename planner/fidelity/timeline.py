"""The timeline PNG: a Gantt chart of a measured step (the runtime's trace events) above the
schedule simulated from the plan (`runtime execute --timeline`, `planner simulate --timeline`)."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from planner.jsonio import atomic_path, image_format

_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "backward_input": "#dd8452", "backward_weight": "#937860",
            "recv_act": "#cccccc", "recv_grad": "#cccccc",
            "send_act": "#55a868", "send_grad": "#55a868", "batch": "#55a868", "reduce": "#c44e52",
            "optimizer_step": "#8172b3"}


def timeline_png(rank_events: Dict[int, List[List[Any]]], predicted: Sequence[Any], step: int, path: str) -> None:
    """Gantt chart of one measured step (top; omitted when `rank_events` is empty) and the
    simulated prediction (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [("predicted (simulated from the plan)", _predicted_rows(predicted))]
    if rank_events:
        panels.insert(0, (f"measured (step {step})", _measured_rows(rank_events, step)))
    ranks = sorted(set(rank_events) | {e.rank for e in predicted})
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.2 + 0.9 * len(ranks) * len(panels)), sharex=True,
                             squeeze=False)
    axes = axes[:, 0]
    for ax, (title, rows) in zip(axes, panels):
        for rank, kind, i, start, end in rows:
            if end - start <= 0:
                continue
            ax.barh(rank, (end - start) * 1e3, left=start * 1e3, color=_COLOURS.get(kind, "#999999"),
                    edgecolor="white", linewidth=0.4)
            if kind in ("forward", "backward", "backward_input", "backward_weight") and end - start > 0:
                ax.text((start + end) / 2 * 1e3, rank, str(i), ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(ranks)
        ax.set_yticklabels([f"rank {r}" for r in ranks])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1].set_xlabel("ms")
    fig.legend(handles=[Patch(color=_COLOURS[k], label="messages" if k == "batch" else k.replace("_", " ")) for k in
                        ("forward", "backward", "backward_weight", "batch", "reduce", "optimizer_step")],
               loc="upper right", fontsize=7, ncol=6)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=image_format(path, "--timeline"))
    plt.close(fig)


def _measured_rows(rank_events: Dict[int, List[List[Any]]], step: int):
    """The events of one step, per rank, relative to that step's earliest start."""
    per_rank = {}
    for rank, events in rank_events.items():
        # A step ends with the optimizer step: split the event list at those.
        steps, current = [], []
        for e in events:
            current.append(e)
            if e[0] == "optimizer_step":
                steps.append(current)
                current = []
        per_rank[rank] = steps[step] if step < len(steps) else []
    origin = min((e[3] for evs in per_rank.values() for e in evs), default=0.0)
    return [(rank, e[0], e[1], e[3] - origin, e[4] - origin) for rank, evs in per_rank.items() for e in evs]


def _predicted_rows(predicted: Sequence[Any]):
    """Simulated events (planner.pipeline.simulate.SimEvent): a batch of messages is drawn as one bar."""
    return [(e.rank, "batch" if e.kind.startswith("batch") else e.kind, e.micro_batch, e.start, e.end)
            for e in predicted]
