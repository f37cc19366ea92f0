"""Checkpoints: each rank saves its stages' parameters, buffers and optimizer state atomically;
rank 0 then marks the step complete. `--resume` continues from the last complete step.

    DIR/step-000004/rank0.pt ... rank{W-1}.pt   (torch.save of tensors and plain values only)
    DIR/latest.json                             {"schema_version", "completed_steps", "plan_hash", "world_size"}

A step directory without a matching latest.json (a crash mid-save) is ignored on resume.
Files are read back with `torch.load(weights_only=True)`: nothing is unpickled.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from planner.jsonio import JsonFileError, atomic_path, read_json, write_json_atomic

CHECKPOINT_SCHEMA_VERSION = 1


class CheckpointError(RuntimeError):
    pass


def _step_dir(directory: str, completed_steps: int) -> str:
    return os.path.join(directory, f"step-{completed_steps:06d}")


def save_rank(directory: str, completed_steps: int, rank: int, stages_state: Dict[str, Any],
              optimizer_state: Dict[str, Any]) -> None:
    path = os.path.join(_step_dir(directory, completed_steps), f"rank{rank}.pt")
    with atomic_path(path) as tmp:
        # "chunks": the stages' states by index (the file's key since its first version)
        torch.save({"completed_steps": completed_steps, "chunks": stages_state, "optimizer": optimizer_state}, tmp)


def mark_complete(directory: str, completed_steps: int, plan_hash: str, world_size: int) -> None:
    write_json_atomic(os.path.join(directory, "latest.json"), {
        "schema_version": CHECKPOINT_SCHEMA_VERSION, "completed_steps": completed_steps,
        "plan_hash": plan_hash, "world_size": world_size})


def latest(directory: str, plan_hash: str, world_size: int) -> Optional[int]:
    """Completed steps of the last checkpoint in `directory`, or None if there is none."""
    path = os.path.join(directory, "latest.json")
    if not os.path.exists(path):
        return None
    try:
        meta = read_json(path, what="checkpoint marker")
    except JsonFileError as e:
        raise CheckpointError(str(e)) from None
    if meta.get("plan_hash") != plan_hash:
        raise CheckpointError(f"the checkpoint in {directory!r} was written for a different plan; resume with the "
                              "same plan file or use a new --checkpoint-dir")
    if int(meta.get("world_size", -1)) != world_size:
        raise CheckpointError(f"the checkpoint in {directory!r} has {meta.get('world_size')} ranks, this run "
                              f"{world_size}")
    return int(meta["completed_steps"])


def load_rank(directory: str, completed_steps: int, rank: int) -> Dict[str, Any]:
    path = os.path.join(_step_dir(directory, completed_steps), f"rank{rank}.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path!r} is missing; resume from another directory")
    return torch.load(path, weights_only=True)
