"""Build one rank's stage from a plan: rebuild the model, re-capture it, cut out the stage's units.

Every rank builds the full spec after `torch.manual_seed(seed)` (identical weights everywhere),
captures the same fx graph the profile was made from, and checks that the graph still has
the plan's units and cut values before cutting out its own `fx.GraphModule`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch
from torch import fx

from planner.capture import CapturedModel, StageIO, capture
from planner.spec import ModelSpec, build_spec


class PlanMismatchError(RuntimeError):
    """The model no longer matches the plan (changed code or arguments since profiling)."""


@dataclass
class Stage:
    index: int
    num_stages: int
    module: fx.GraphModule
    io: StageIO
    recv: List[Dict[str, Any]]  # the plan's descriptions of the values crossing the first cut
    send: List[Dict[str, Any]]  # ... and of those crossing the end cut
    state_keys: List[str]  # keys of the model's state_dict this stage owns (saved from this rank)
    model_inputs: List[str]  # the model's forward arguments, in order (fx placeholder names)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def _check_units(plan: Dict[str, Any], captured: CapturedModel) -> None:
    planned = [name for stage in plan["stages"] for name in stage["units"]]
    actual = captured.unit_names
    if planned != actual:
        first_difference = next((i for i, (a, b) in enumerate(zip(planned, actual)) if a != b),
                                min(len(planned), len(actual)))
        raise PlanMismatchError(
            f"the model's graph has {len(actual)} units but the plan names {len(planned)}, first difference at "
            f"unit {first_difference}; the model changed since it was profiled: re-run `planner profile` and "
            "`planner solve`")


def _check_values(where: str, planned: List[Dict[str, Any]], actual: List[str]) -> None:
    names = [v["name"] for v in planned]
    if names != actual:
        raise PlanMismatchError(f"{where}: the plan sends {names} but the model's graph has {actual}; "
                                "re-run `planner profile` and `planner solve`")


def build_stage(plan: Dict[str, Any], stage_index: int) -> "tuple[ModelSpec, Stage]":
    model = plan["model"]
    spec = build_spec(model["entry"], model.get("args", {}), int(model.get("seed", 0)))
    captured = capture(spec.module)
    _check_units(plan, captured)
    stages = plan["stages"]
    ranges = [(int(s["first_unit"]), int(s["end_unit"])) for s in stages]
    modules = [captured.stage_module(first, end) for first, end in ranges]

    # A parameter used by two stages would be trained twice, out of step: refuse it clearly.
    owner: Dict[str, int] = {}
    for s, (module, _) in enumerate(modules):
        for name, _ in module.named_parameters():
            if name in owner and owner[name] != s:
                raise PlanMismatchError(
                    f"parameter {name!r} is used by stages {owner[name]} and {s} (shared/tied weights); "
                    "this runtime needs each parameter in one stage: re-solve so both uses share a stage")
            owner.setdefault(name, s)

    # Each model state entry is saved by the first stage that holds it; rank 0 also saves the
    # entries no stage uses, so the merged state_dict is complete.
    model_keys = list(spec.module.state_dict().keys())
    holder: Dict[str, int] = {}
    for s, (module, _) in enumerate(modules):
        for key in module.state_dict().keys():
            holder.setdefault(key, s)
    state_keys = [k for k in model_keys if holder.get(k, 0) == stage_index]

    module, io = modules[stage_index]
    plan_stage = stages[stage_index]
    _check_values(f"stage {stage_index} input", plan_stage.get("recv", []), io.received)
    _check_values(f"stage {stage_index} output", plan_stage.get("send", []), io.sent)
    stage = Stage(index=stage_index, num_stages=len(stages), module=module, io=io,
                  recv=list(plan_stage.get("recv", [])), send=list(plan_stage.get("send", [])),
                  state_keys=state_keys, model_inputs=list(captured.placeholders))
    return spec, stage


def stage_state(stage: Stage, spec: ModelSpec) -> Dict[str, torch.Tensor]:
    """The model state entries this stage owns, under their original names, on the CPU."""
    own = stage.module.state_dict()  # its tensors may have moved to the device: read them here
    full = spec.module.state_dict()  # entries no stage uses keep their initial values
    return {k: (own[k] if k in own else full[k]).detach().cpu().clone() for k in stage.state_keys}
