"""A profiling run's timings at one micro-batch size: its units round-robin with the whole model
in the same rounds, their backward parts with later stages timed whole, and one optimizer step over
each unit's parameters; what a stage pays once is kept apart from its units' times.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from planner.model.capture import CaptureError
from planner.model.failures import UnitRunError, first_line, unit_failure
from planner.profile.optim import OPTIMIZERS
from planner.profile.profile_run import ProfileRun, stage_item, tail_firsts
from planner.profile.splitgrad import measure_backward_parts
from planner.profile.timing import (UnitCall, UnitTiming, measure_optimizer_steps, measure_units, split_call_overhead,
                                    weight_walk)


def time_parts(run: ProfileRun, work: List[UnitCall], values: Dict[str, Any], target: Any, b: int):
    """Per unit, (input part, weight part) seconds and the bytes held between them; what a split
    costs a stage on top of its units goes to `run.split_overhead[b]` (Profile.split_overhead_s).

    Every unit but the first is timed alone with gradients flowing into its inputs, as in a later
    stage, and so pays what such a stage's split pays once (the engine's calls, the graph's
    analysis). With the whole model measured, the units from the second on are also timed as one
    stage in the same rounds, and `split_call_overhead` keeps that cost apart, as `time_units`
    does for the whole backward; the weight part's calls also walk the stage's earlier units, so the
    units from the middle on are timed as a stage too, and `weight_walk` finds both its per-stage
    cost and the walk's (quadratic in a stage's units). The whole model's input part is the first
    stage's (it runs no autograd). Without it, each unit's parts as timed and the first unit's input part stand in."""
    L = len(work)
    half = tail_firsts(L)[-1]  # the second later stage, [half, L)
    extra = [stage_item(run, values, first) for first in tail_firsts(L)] if run.whole_model else []
    try:
        parts = measure_backward_parts(work + extra, run.spec.loss, target, run.dev, run.repeats)
    except torch.cuda.OutOfMemoryError:  # the model does not fit as one stage here: its units alone
        torch.cuda.empty_cache()
        extra, parts = [], measure_backward_parts(work, run.spec.loss, target, run.dev, run.repeats)
    units, stages = parts[:L], parts[L:]
    input_s, weight_s = [p.input_s for p in units], [p.weight_s for p in units]
    later_input = later_weight = walk = 0.0
    if len(stages) >= 2:
        inputs = split_call_overhead(input_s[1:], stages[1].input_s)
        input_s[1:], later_input = inputs.unit_s, inputs.call_s
        # the weight part's calls walk the graph below them: quadratic in a stage's units (weight_walk)
        fit = weight_walk(weight_s[1:], [p.weight_calls for p in units[1:]], [p.graph_nodes for p in units[1:]],
                          [(0, stages[1].weight_s)] + ([(half - 1, stages[2].weight_s)] if len(stages) > 2 else []))
        weights, walk = fit or (split_call_overhead(weight_s[1:], stages[1].weight_s), 0.0)
        weight_s[1:], later_weight = weights.unit_s, weights.call_s
    run.split_overhead[b] = ((stages[0] if stages else units[0]).input_s, later_input, later_weight)
    run.weight_walk[b] = walk
    return [((i, w), p.held_bytes, p.kept_bytes, p.weight_calls, p.graph_nodes)
            for i, w, p in zip(input_s, weight_s, units)]


def time_units(run: ProfileRun, work: List[UnitCall], values: Dict[str, Any], target: Any, b: int) -> List[UnitTiming]:
    """The units timed round-robin, with the whole model timed in the same rounds: a unit timed
    alone pays a call's fixed cost (module call, autograd.backward, the seed gradient) that a stage
    of several units pays once; it is kept apart as the stage's own cost (BENCHMARKS.md: what it
    amounts to on the built-in models)."""
    loss, dev = run.spec.loss, run.dev
    whole = stage_item(run, values, 0) if run.whole_model else None  # all units, as a 1-stage run calls them
    try:
        measured = measure_units(work + ([whole] if whole else []), loss, target, dev, run.repeats,
                                 warmup_s=run.warmup_s, min_time_s=run.min_time_s)
    except UnitRunError as e:
        if e.index == len(work):  # the whole model as one stage, after each of its units ran alone
            raise CaptureError(f"the whole model as one stage raised {first_line(e.cause)} in its {e.phase} "
                               "(each unit alone did not); PLANNER_TRACEBACK=1 shows the stack") from e
        raise unit_failure(run.captured.unit_names[e.index], len(work), e, work[e.index].module,
                           work[e.index].args) from e
    except torch.cuda.OutOfMemoryError:
        if whole is None:
            raise
        whole = None  # the model does not fit as one stage here: unit times as measured
        torch.cuda.empty_cache()
        measured = measure_units(work, loss, target, dev, run.repeats, warmup_s=run.warmup_s,
                                 min_time_s=run.min_time_s)
    if whole is None:
        return measured
    whole_timing, measured = measured[-1], measured[:-1]
    forward = split_call_overhead([t.forward_s for t in measured], whole_timing.forward_s)
    backward = split_call_overhead([t.backward_s for t in measured], whole_timing.backward_s)
    run.whole_scale[b] = {"forward": forward.scale, "backward": backward.scale}
    run.stage_overhead[b] = (forward.call_s, backward.call_s)
    return [UnitTiming(f, g, t.saved_bytes) for f, g, t in zip(forward.unit_s, backward.unit_s, measured)]


def measure_optimizer(run: ProfileRun) -> None:
    """One optimizer step over each unit's parameters, under the same load as the units: the ranks
    step their optimizers while the others compute."""
    steps = measure_optimizer_steps([list(stage.parameters()) for stage, _ in run.stages], run.dev, run.repeats,
                                    min_time_s=min(run.min_time_s, 0.5))
    for unit, step in zip(run.units, steps):
        unit.optimizer_s = step
    totals = {name: sum(step.get(name, 0.0) for step in steps) for name in OPTIMIZERS}
    run.say("  optimizer step over all units: " + ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in totals.items()))
