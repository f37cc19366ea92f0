"""ProfileRun: one profiling run's state (the model, its units as stage modules, what has been
measured so far), and its preparation before any size is measured (`prepare`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from planner.model.capture import CapturedModel, run_all_nodes
from planner.model.failures import NodeRunError, model_failure
from planner.model.parameter_views import units_passing_parameter_views
from planner.model.running_stats import state_writers
from planner.model.forward_state import loss_value_refused, state_read_by_loss
from planner.model.spec import ModelEntryError, ModelSpec, batch_problem, to_device
from planner.profile.corunners import CoRunners
from planner.profile.cut_profile import CutValue
from planner.profile.mixed import MixedRun
from planner.profile.records import blank_unit, prepare_args
from planner.profile.timing import UnitCall
from planner.profile.unit_profile import UnitProfile


@dataclass
class ProfileRun:
    """One profiling run: the model, its captured units and what has been measured so far."""

    spec: ModelSpec
    captured: CapturedModel
    dev: torch.device
    repeats: int
    warmup_s: float
    min_time_s: float
    whole_model: bool
    say: Callable[[str], None]
    co: Optional[CoRunners] = None  # processes loading the other cores while units are timed
    mixed: Optional[MixedRun] = None  # bf16-mixed: the units run as such a rank runs them
    stages: List[Any] = field(default_factory=list)  # (module, io) of each unit run alone
    tails: Dict[int, Any] = field(default_factory=dict)  # first -> (module, io) of units [first, L) as one stage
    grad_flags: Dict[str, bool] = field(default_factory=dict)  # which crossing values carry gradients
    inner: Optional["InnerSources"] = None  # the values' sources (planner.profile.saved_storages.inner_counts)
    units: List[UnitProfile] = field(default_factory=list)
    cut_values: Dict[int, Dict[str, CutValue]] = field(default_factory=dict)
    whole_scale: Dict[int, Dict[str, float]] = field(default_factory=dict)
    stage_overhead: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    split_overhead: Dict[int, Tuple[float, float, float]] = field(default_factory=dict)
    weight_walk: Dict[int, float] = field(default_factory=dict)
    data_sized: Dict[int, Dict[str, Any]] = field(default_factory=dict)  # planner.profile.data_sized, per size

    def trainable(self, module: torch.nn.Module) -> Optional[List[torch.Tensor]]:
        """UnitCall.params of a call of `module`: the masters under bf16-mixed, else the module's (None)."""
        return self.mixed.trainable(module) if self.mixed is not None else None

    def forwarding(self):
        """The context a forward outside the stage modules runs in (the whole model's values)."""
        return self.mixed.autocast() if self.mixed is not None else contextlib.nullcontext()


def carries_gradient(values: Dict[str, Any]) -> Dict[str, bool]:
    """Which of a grad-enabled run's values carry a gradient: a tensor that requires one, or a tuple, list or
    dict holding one (a `chunk`'s parts reach their readers through the tuple's node)."""
    def carries(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            return value.requires_grad
        if isinstance(value, (tuple, list)):
            return any(carries(v) for v in value)
        return isinstance(value, dict) and any(carries(v) for v in value.values())
    return {name: carries(value) for name, value in values.items()}


def value_sources(captured: CapturedModel, grad_flags: Dict[str, bool]) -> Dict[str, int]:
    """Each computed value's source: the first unit whose values its gradient flows back into (through values
    that carry one; parameters belong to no unit). A stage starting at or before the source of a value it
    reads computes that value from its own parameters alone: its input part does not reach it, and the
    weight part keeps the gradients where it meets the stage's inputs (UnitProfile.inner_weight_bytes)."""
    unit_of = {node.name: k for k, unit in enumerate(captured.units) for node in unit.nodes}
    sources: Dict[str, int] = {}
    for node in captured.gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        found = [sources[m.name] for m in node.all_input_nodes if grad_flags.get(m.name) and m.name in sources]
        own = unit_of.get(node.name)
        sources[node.name] = min(found + ([own] if own is not None else []), default=len(captured.units))
    return sources


@dataclass
class InnerSources:
    """What planner.profile.saved_storages.inner_counts reads of a profile's graph, found once: each value's
    source (`value_sources`), which values carry a gradient, and the first cut (>= 1) a stage
    starting at which has an input part (a value crossing it carries a gradient; planner.cost.ranges'
    `whole` before it, whose weight part holds all anyway)."""

    sources: Dict[str, int]
    grad_flags: Dict[str, bool]
    first_input: int

    @classmethod
    def of(cls, captured: CapturedModel, probe: Dict[str, Any], grad_flags: Dict[str, bool]) -> "InnerSources":
        """From a grad-enabled run's values (`probe`) and their gradient flags."""
        L = len(captured.units)
        first = next((a for a in range(1, L) if any(grad_flags.get(n.name) for n in captured.crossing(a))), L)
        return cls(value_sources(captured, carries_gradient(probe)), grad_flags, first)


def tail_firsts(num_units: int) -> List[int]:
    """The first units of the stages [first, L) timed whole: the whole model, a later stage from unit
    1 (its split backward's per-stage cost), and a second from the middle (the weight part's walk
    and its per-stage cost apart)."""
    L = num_units
    return [0] + ([1] if L >= 3 else []) + ([(L + 1) // 2] if L >= 4 else [])


def stage_item(run: ProfileRun, values: Dict[str, Any], first: int) -> UnitCall:
    """Units [first, L) as the last stage of a run calls them (what crosses cut `first` carries
    gradients as it does there); the stage module built once (`prepare`)."""
    stage, io = run.tails[first]
    flags = {n: run.cut_values[first][n].requires_grad for n in io.received} if first else {}
    return UnitCall(stage, prepare_args(values, io.inputs + io.received, flags, run.dev), [], True,
                    run.trainable(stage))


def prepare(run: ProfileRun, smallest: int, precision: str = "fp32") -> None:
    """Each unit as a stage of its own (and the stages of units [first, L) that `time_units` and
    `time_parts` time whole, planner.profile.run_timing), which crossing values carry gradients, and
    empty records; under bf16-mixed the modules then run as such a run's (`MixedRun`: its graph rules
    edit the whole model's graph, from which no stage is cut after it)."""
    captured, L = run.captured, len(run.captured.units)
    run.stages = [captured.stage_module(k, k + 1) for k in range(L)]
    if run.whole_model:
        run.tails = {first: captured.stage_module(first, L) for first in tail_firsts(L)}
    # Which crossing values carry gradients: one forward with autograd on, at the smallest size.
    inputs0, target0 = run.spec.batch(smallest, 0)
    problem = batch_problem(inputs0, target0, smallest)
    if problem:
        raise ModelEntryError(problem)
    if precision == "bf16-mixed":  # the probe too: an exported graph's casts expect the bf16 copies
        run.mixed = MixedRun([captured.gm] + [m for m, _ in run.stages] + [m for m, _ in run.tails.values()], run.dev)
        run.mixed.install()
    with torch.enable_grad():
        try:
            with run.forwarding():
                probe = run_all_nodes(captured, to_device(tuple(inputs0), run.dev), grad=True)
        except NodeRunError as e:
            raise model_failure(e, smallest) from e
        finally:
            if run.mixed is not None:
                run.mixed.remove()
    run.grad_flags = {n: bool(isinstance(v, torch.Tensor) and v.requires_grad) for n, v in probe.items()}
    run.inner = InnerSources.of(captured, probe, run.grad_flags)
    loss_value_refused(run.spec.loss, captured.output_of(probe), to_device(target0, run.dev))
    # a loss reading what forward sets on the model, or state the last stage does not hold, stops here in one line
    state_read_by_loss(run.spec.loss, run.spec.module, captured.output_of(probe), to_device(target0, run.dev),
                       [module for module, _ in run.stages])
    views = units_passing_parameter_views(captured, probe)
    del probe
    writers = state_writers(captured)
    run.units = [blank_unit(u, run.stages[k][0], k in writers, parameter_view=k in views)
                 for k, u in enumerate(captured.units)]
    run.cut_values = {k: {} for k in range(1, L)}
    if run.mixed is not None:
        run.spec = dataclasses.replace(run.spec, loss=run.mixed.loss(run.spec.loss))
