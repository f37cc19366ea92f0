"""The batch a micro-batch size is measured on where the data sets values' shapes.

A routed block (`sel = nonzero(x[:, 0] > t)`, `w(h[sel])`) saves for backward as many rows as the
batch routes, so its activation memory differs from batch to batch; capture keeps such values
inside units (planner.model.dynamic_shapes) but the bytes a unit saves still follow the data. The
profile measures every size on one batch, so for such a model it first runs the whole graph on
each of the first `PROBED_BATCHES` batches of the size, counting what the forward saves, and
measures on the batch that saved the most: the plan's activation memory is the largest the profile
saw, not the first batch's (a batch routing more rows than any probed can still hold more; the
profile's `data_sized` records the spread).
"""
from __future__ import annotations

from typing import Dict, List

from planner.model.capture import run_all_nodes
from planner.model.failures import NodeRunError, model_failure
from planner.model.spec import ModelEntryError, batch_problem, to_device
from planner.profile.saved import SavedBytes

PROBED_BATCHES = 8


def measuring_step(run, b: int) -> int:
    """The step whose batch of size b the profile measures (`run`: planner.profile.profile_run.ProfileRun):
    0, or where the data sets shapes the one of the first PROBED_BATCHES whose forward saves the most
    (the first of equals), recorded in `run.data_sized[b]`."""
    captured = run.captured
    if not captured.data_sized:
        return 0
    saved: List[int] = []
    params = [*captured.gm.parameters(), *captured.gm.buffers()]
    for step in range(PROBED_BATCHES):
        inputs, target = run.spec.batch(b, step)
        problem = batch_problem(inputs, target, b)
        if problem:
            raise ModelEntryError(problem)
        counter = SavedBytes(params)
        try:
            with run.forwarding(), counter.counting():
                values = run_all_nodes(captured, to_device(tuple(inputs), run.dev, copy=True), grad=True)
        except NodeRunError as e:
            raise model_failure(e, b) from e
        saved.append(counter.finish())
        del values
    chosen = saved.index(max(saved))
    run.data_sized[b] = {"batches": PROBED_BATCHES, "measured_step": chosen, "saved_bytes": [min(saved), max(saved)]}
    if max(saved) > min(saved):
        run.say(f"  b={b:<4} the data sets some values' shapes: of the first {PROBED_BATCHES} batches the forward "
                f"saved {min(saved)}..{max(saved)} bytes; measured on batch {chosen}, the largest")
    return chosen


def data_sized_json(run) -> Dict[str, object]:
    """The profile's record of it (Profile.extra["data_sized"]), or {} where no shape follows the data."""
    if not run.data_sized:
        return {}
    units = sorted({k for k, unit in enumerate(run.captured.units)
                    if any(node.name in run.captured.data_sized for node in unit.nodes)})
    return {"units": [run.captured.unit_names[k] for k in units],
            "sizes": {str(b): record for b, record in sorted(run.data_sized.items())}}
