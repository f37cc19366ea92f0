"""A run's timeline as a Chrome trace (open in https://ui.perfetto.dev). The PNG Gantt chart beside
the prediction is planner.fidelity.timeline."""
from __future__ import annotations

from typing import Any, Dict, List

from planner.jsonio import write_json_atomic


def chrome_trace(rank_events: Dict[int, List[List[Any]]], path: str) -> None:
    """One track per rank: every action as a complete ('X') event, microseconds from the run's start."""
    origin = min((e[3] for events in rank_events.values() for e in events), default=0.0)
    trace = []
    for rank, events in sorted(rank_events.items()):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for kind, i, g, start, end in events:
            name = kind if i < 0 else f"{kind} mb{i} s{g}"
            trace.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": rank,
                          "ts": (start - origin) * 1e6, "dur": max(end - start, 0.0) * 1e6,
                          "args": {"micro_batch": i, "stage": g}})
    write_json_atomic(path, {"traceEvents": trace, "displayTimeUnit": "ms"})
