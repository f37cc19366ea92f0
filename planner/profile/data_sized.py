"""The batch a micro-batch size is measured on where the data sets values' shapes.

A routed block (`sel = nonzero(x[:, 0] > t)`, `w(h[sel])`) saves for backward as many rows as the
batch routes, so its activation memory differs from batch to batch; capture keeps such values
inside units (planner.model.dynamic_shapes) but the bytes a unit saves still follow the data. The
profile measures every size on one batch, so for such a model it first runs the whole graph on
each of the first `PROBED_BATCHES` batches of the size, counting what the forward saves, and
measures on the batch that saved the most. A unit whose own bytes peaked on another probed batch (two
routed blocks peaking apart) has the difference added to its held bytes (`add_unit_peaks`). The
plan's activation memory is then the largest the profile saw, not the first batch's (a batch routing
more rows than any probed can still hold more; the profile's `data_sized` records the spread). What
the loss saves can follow the target's values alone (CTC): for every model the loss runs on the measured
output with each probed batch's target, and the last unit gets what it saved more (`add_loss_peak`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import torch
from torch.utils._pytree import tree_leaves

from planner.model.capture import run_all_nodes
from planner.model.failures import NodeRunError, model_failure
from planner.model.spec import ModelEntryError, batch_problem, to_device
from planner.profile.saved import Packed, local_tensor, loss_saved_bytes, unpack

PROBED_BATCHES = 8


def measuring_step(run, b: int) -> Tuple[int, List[int]]:
    """The step whose batch of size b the profile measures (`run`: planner.profile.profile_run.ProfileRun),
    and what each unit saved at most on another probed batch beyond that one: (0, no units) where no
    shape follows the data, else the first of the PROBED_BATCHES batches whose units save the most
    (recorded in `run.data_sized[b]`)."""
    captured = run.captured
    if not captured.data_sized:
        return 0, []
    state = {local_tensor(t).untyped_storage().data_ptr() for t in [*captured.gm.parameters(), *captured.gm.buffers()]}
    per_unit: List[List[int]] = []
    for step in range(PROBED_BATCHES):
        inputs, target = run.spec.batch(b, step)
        problem = batch_problem(inputs, target, b)
        if problem:
            raise ModelEntryError(problem)
        try:
            with run.forwarding():
                per_unit.append(_saved_per_unit(captured, to_device(tuple(inputs), run.dev, copy=True), state))
        except NodeRunError as e:
            raise model_failure(e, b) from e
    saved = [sum(units) for units in per_unit]
    chosen = saved.index(max(saved))
    run.data_sized[b] = {"batches": PROBED_BATCHES, "measured_step": chosen, "saved_bytes": [min(saved), max(saved)]}
    if max(saved) > min(saved):
        run.say(f"  b={b:<4} the data sets some values' shapes: of the first {PROBED_BATCHES} batches the units "
                f"saved {min(saved)}..{max(saved)} bytes; measured on batch {chosen}, the largest")
    return chosen, [max(units[k] for units in per_unit) - per_unit[chosen][k] for k in range(len(captured.units))]


def add_unit_peaks(run, b: int, peaks: List[int]) -> None:
    """Add to each unit's held bytes at size b what it saved more on another probed batch than on the one
    measured (`measuring_step`'s second value); the profile's `data_sized` keeps the amounts."""
    if b not in run.data_sized:
        return
    added = run.data_sized[b]["added_bytes"] = {}
    for unit, extra in zip(run.units, peaks):
        if extra <= 0:
            continue
        added[unit.name] = extra
        for counts in (unit.saved_bytes, unit.first_saved_bytes, unit.weight_held_bytes, unit.first_weight_held_bytes):
            if b in counts:
                counts[b] += extra


def add_loss_peak(run, b: int, output, target, kept=()) -> None:
    """Add to the last unit's held bytes at size b what the loss saves more on another probed batch's
    target than on the measured one's (`target`; its count already in the unit's loss_saved_bytes), from the
    measured `output` (`kept`: what is held anyway, planner.profile.saved.held_beside_loss): what a loss saves
    can follow the target's values where the graph's shapes do not (CTC's alignment table is as long as the
    batch's longest label sequence). Targets of other shapes than the measured one are not probed."""
    shapes = [tuple(t.shape) for t in tree_leaves(target) if isinstance(t, torch.Tensor)]
    counts = []
    for step in range(PROBED_BATCHES):
        try:
            probe = to_device(run.spec.batch(b, step)[1], run.dev, copy=True)
        except Exception:  # a batch the model cannot make at a later step: the run reports it at that step
            break
        if [tuple(t.shape) for t in tree_leaves(probe) if isinstance(t, torch.Tensor)] == shapes:
            counts.append(loss_saved_bytes(run.spec.loss, output, probe, kept))
    last = run.units[-1]
    extra = max(counts, default=0) - last.loss_saved_bytes[b]  # (the measured target's, measure._measure_size)
    if extra <= 0:
        return
    for held in (last.saved_bytes, last.first_saved_bytes, last.loss_saved_bytes):
        if b in held:
            held[b] += extra
    run.data_sized.setdefault(b, {"batches": PROBED_BATCHES})["loss_added_bytes"] = extra
    run.say(f"  b={b:<4} the loss saves {extra} bytes more on another of the first {PROBED_BATCHES} targets than on "
            f"the measured one's: added to {last.name}")


def _saved_per_unit(captured, inputs, state: Set[int]) -> List[int]:
    """The bytes each unit's operations save for backward in one forward of the graph (storages in
    `state`, the parameters' and buffers', not counted; a storage once per unit)."""
    storages: List[Dict[int, int]] = [{} for _ in captured.units]
    unit: Optional[int] = None  # the unit of the node running

    def entering(node) -> None:
        nonlocal unit
        unit = captured.unit_of_node(node.name)

    def pack(tensor: torch.Tensor) -> Packed:
        storage = tensor.untyped_storage()
        if unit is not None and storage.data_ptr() and storage.data_ptr() not in state:
            storages[unit][storage.data_ptr()] = storage.nbytes()
        return Packed(tensor)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        run_all_nodes(captured, inputs, grad=True, entering=entering)
    return [sum(held.values()) for held in storages]


def data_sized_json(run) -> Dict[str, object]:
    """The profile's record of it (Profile.extra["data_sized"], where some shape follows the data)."""
    units = sorted({k for k, unit in enumerate(run.captured.units)
                    if any(node.name in run.captured.data_sized for node in unit.nodes)})
    return {"units": [run.captured.unit_names[k] for k in units],
            "sizes": {str(b): record for b, record in sorted(run.data_sized.items())}}
