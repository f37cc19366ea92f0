"""A step's micro-batches, and the values a stage receives, as the engine hands them to a stage."""
from __future__ import annotations

from typing import Any, List, Tuple

import torch

from planner.model.spec import batch_problem
from runtime.stage import RankStage


class BatchError(ValueError):
    """The model's batch function does not produce what the plan needs."""


def split_micro_batches(obj: Any, total: int, parts: int, what: str) -> List[Any]:
    """Split every tensor in `obj` (tensor, tuple, list, dict) into `parts` equal parts along dim 0."""
    size = total // parts
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] != total:
            raise BatchError(f"{what} has shape {tuple(obj.shape)}; every batch tensor needs the batch "
                             f"({total}) on dim 0")
        return [obj.narrow(0, i * size, size) for i in range(parts)]
    if isinstance(obj, (tuple, list)):
        split = [split_micro_batches(o, total, parts, f"{what}[{j}]") for j, o in enumerate(obj)]
        return [type(obj)(p[i] for p in split) for i in range(parts)]
    if isinstance(obj, dict):
        split = {k: split_micro_batches(v, total, parts, f"{what}[{k!r}]") for k, v in obj.items()}
        return [{k: split[k][i] for k in obj} for i in range(parts)]
    return [obj] * parts  # non-tensor values (flags) go to every part


def replica_micro_batches(spec: Any, rank_model: Any, global_batch: int, data_parallel: int, replica: int,
                          num_micro_batches: int, step: int) -> Tuple[List[Any], List[Any]]:
    """(inputs, targets) of each of this replica's micro-batches of `step`: the model's batch (every
    rank builds it), its inputs aligned with the graph's placeholders, split over the replicas and
    then into micro-batches."""
    inputs, target = spec.batch(global_batch, step)
    problem = batch_problem(inputs, target, global_batch)
    if problem:
        raise BatchError(problem)
    flat = rank_model.input_values(inputs)
    mine = split_micro_batches([flat, target], global_batch, data_parallel, "batch")[replica]
    per_replica = global_batch // data_parallel
    return (split_micro_batches(mine[0], per_replica, num_micro_batches, "inputs"),
            split_micro_batches(mine[1], per_replica, num_micro_batches, "target"))


def _constant(value: Any) -> Any:
    """Constants arrive as JSON lists; sizes were tuples in the model."""
    if isinstance(value, list):
        return tuple(_constant(v) for v in value)
    return value


def assemble(stage: RankStage, tensors: List[torch.Tensor]) -> List[Any]:
    """Received tensors and injected constants, in the stage's input order (leaves needing a
    gradient where the plan says the value carries one)."""
    values: List[Any] = []
    it = iter(tensors)
    for spec in stage.recv:
        if spec["kind"] == "tensor":
            t = next(it)
            if spec.get("requires_grad"):
                t.requires_grad_(True)
            values.append(t)
        else:
            values.append(_constant(spec["value"]))
    return values
