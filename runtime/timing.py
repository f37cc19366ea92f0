"""Timing a step's actions: on the CPU with the host clock, on CUDA with events, read once per step.

A CUDA kernel runs after the host has queued it, so the host clock around an action measures the
queueing, not the work. `StepClock` records a pair of events around each action on the current
stream and reads them all after the step's one synchronisation (`finish`); the spans then say how
long the stream spent from the action's first kernel to its last, waits included (a batch's
`wait()` on NCCL makes the compute stream wait for the transfer). On the CPU the spans are the
host clock's. Either way each span also carries its wall-clock start and end, for traces.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


class StepClock:
    """`start()`, then `mark(key)` before and `stop(key, label)` after each timed span, then
    `finish()` -> (seconds per key, [(label, wall start, wall end)], step seconds)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._offset = time.time() - time.perf_counter()  # perf_counter -> wall clock
        self._spans: List[Tuple[str, object, object, object]] = []
        self._open: object = None
        self._step_start: object = None
        self._wall_start = 0.0

    def _now(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._spans.clear()
        if self.cuda:
            torch.cuda.synchronize()  # the previous step's work is not this step's
        self._wall_start = time.perf_counter()
        self._step_start = self._now()

    def mark(self) -> None:
        self._open = self._now()

    def stop(self, key: str, label: object) -> None:
        self._spans.append((key, label, self._open, self._now()))

    def finish(self) -> Tuple[Dict[str, float], List[Tuple[object, float, float]], float]:
        """The step's one synchronisation, then every span read."""
        end = self._now()
        totals: Dict[str, float] = {}
        wall: List[Tuple[object, float, float]] = []
        if self.cuda:
            torch.cuda.synchronize()
            origin = self._step_start
            base = self._wall_start + self._offset
            for key, label, t0, t1 in self._spans:
                seconds = t0.elapsed_time(t1) / 1e3
                totals[key] = totals.get(key, 0.0) + seconds
                start = base + origin.elapsed_time(t0) / 1e3
                wall.append((label, start, start + seconds))
            step_s = origin.elapsed_time(end) / 1e3
        else:
            for key, label, t0, t1 in self._spans:
                totals[key] = totals.get(key, 0.0) + (t1 - t0)
                wall.append((label, t0 + self._offset, t1 + self._offset))
            step_s = end - self._step_start
        return totals, wall, step_s


def close_step(clock: StepClock, stats: Any, trace: Optional[Callable[[str, int, int, float, float], None]]) -> None:
    """Both engines' end of a step: the clock read once, its seconds per key added to `stats` (a
    StepStats), the step's time set, and every span handed to `trace` (an action, a batch's actions,
    or a name)."""
    totals, spans, step_s = clock.finish()
    for key, seconds in totals.items():
        setattr(stats, key, getattr(stats, key) + seconds)
    stats.time_s = step_s
    if trace is None:
        return
    for label, t0, t1 in spans:
        for item in (label if isinstance(label, list) else [label]):
            if hasattr(item, "kind"):  # an Action
                trace(item.kind.value, item.micro_batch, item.stage, t0, t1)
            else:
                trace(item, -1, -1, t0, t1)
