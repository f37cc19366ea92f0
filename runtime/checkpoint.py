"""Checkpoints: each rank saves its stages' parameters, buffers, optimizer state and random
number generators' states atomically and durably (written, fsynced, renamed, directory fsynced);
once every rank has, rank 0 marks the step complete the same way. `--resume`: rank 0 reads the
marker, chooses the step and tells the others (a broadcast), so all ranks resume the same step
even if they read the directory at different moments; each then loads its own file.

    DIR/step-000004/rank0.pt ... rank{W-1}.pt   (torch.save of tensors and plain values only)
    DIR/latest.json                             {"schema_version", "completed_steps", "plan_hash", "world_size"}

DIR must be one directory every rank sees (a shared filesystem across machines: NFS, Lustre, a
mounted bucket with close-to-open consistency), since rank 0 marks a step complete for all.
A step directory without a matching latest.json (a crash mid-save) is ignored on resume.
Files are read back with `torch.load(weights_only=True)`: nothing is unpickled.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from planner.jsonio import JsonFileError, atomic_path, newer_schema, read_json, write_json_atomic

CHECKPOINT_SCHEMA_VERSION = 1


class CheckpointError(RuntimeError):
    pass


def _step_dir(directory: str, completed_steps: int) -> str:
    return os.path.join(directory, f"step-{completed_steps:06d}")


def _fsync(path: str) -> None:
    """Make `path` (a file or a directory's entries) durable before anything depends on it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> Dict[str, Any]:
    """The random number generators a step draws from (dropout): the CPU's and every GPU's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rank(directory: str, completed_steps: int, rank: int, stages_state: Dict[str, Any],
              optimizer_state: Dict[str, Any]) -> None:
    step_dir = _step_dir(directory, completed_steps)
    path = os.path.join(step_dir, f"rank{rank}.pt")
    with atomic_path(path) as tmp:
        # "chunks": the stages' states by index (the file's key since its first version)
        torch.save({"completed_steps": completed_steps, "chunks": stages_state, "optimizer": optimizer_state,
                    "rng": rng_state()}, tmp)
        _fsync(tmp)
    _fsync(step_dir)


def mark_complete(directory: str, completed_steps: int, plan_hash: str, world_size: int) -> None:
    """After every rank's save_rank returned: the step is complete (fsynced before and after)."""
    _fsync(_step_dir(directory, completed_steps))
    path = os.path.join(directory, "latest.json")
    write_json_atomic(path, {
        "schema_version": CHECKPOINT_SCHEMA_VERSION, "completed_steps": completed_steps,
        "plan_hash": plan_hash, "world_size": world_size})
    _fsync(path)
    _fsync(directory)


def latest(directory: str, plan_hash: str, world_size: int) -> Optional[int]:
    """Completed steps of the last checkpoint in `directory`, or None if there is none."""
    path = os.path.join(directory, "latest.json")
    if not os.path.exists(path):
        return None
    try:
        meta = read_json(path, what="checkpoint marker")
    except JsonFileError as e:
        raise CheckpointError(str(e)) from None
    version = meta.get("schema_version") if isinstance(meta, dict) else None
    if version != CHECKPOINT_SCHEMA_VERSION or \
            not _count(meta.get("completed_steps")) or not _count(meta.get("world_size")) or \
            not isinstance(meta.get("plan_hash"), str):
        raise CheckpointError(f"checkpoint marker {path!r} is not one this runtime wrote (schema_version "
                              f"{CHECKPOINT_SCHEMA_VERSION}, completed_steps, world_size, plan_hash); "
                              f"{newer_schema(version, CHECKPOINT_SCHEMA_VERSION)}"
                              "resume from another --checkpoint-dir, or start a new one")
    if meta["plan_hash"] != plan_hash:
        raise CheckpointError(f"the checkpoint in {directory!r} was written for a different plan; resume with the "
                              "same plan file or use a new --checkpoint-dir")
    if meta["world_size"] != world_size:
        raise CheckpointError(f"the checkpoint in {directory!r} has {meta['world_size']} ranks, this run "
                              f"{world_size}")
    return meta["completed_steps"]


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2 ** 62  # (a torch int64)


def restore_rank(saved: Dict[str, Any], stages, optimizer, where: str) -> None:
    """A rank's stages and optimizer from its checkpoint file (`load_rank`), or one line saying why the file
    is not this rank's (another rank's, another plan's model: torch's error lists every key)."""
    for stage in stages:
        chunk = saved["chunks"].get(str(stage.index))
        if chunk is None:
            raise CheckpointError(f"checkpoint {where} holds no stage {stage.index} (it holds "
                                  f"{', '.join(sorted(saved['chunks'])) or 'none'}): not this rank's file; resume from "
                                  "the directory this plan's run wrote")
        try:
            stage.module.load_state_dict(chunk)
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            first = (str(e).strip().splitlines() or [""])[-1].strip()
            raise CheckpointError(f"checkpoint {where} does not fit stage {stage.index} ({first}); resume from "
                                  "the directory this plan's run wrote") from None
    try:
        optimizer.load_state_dict(saved["optimizer"])
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise CheckpointError(f"checkpoint {where} holds another optimizer state ({type(e).__name__}: {e}); resume "
                              "from the directory this plan's run wrote") from None


def load_rank(directory: str, completed_steps: int, rank: int) -> Dict[str, Any]:
    path = os.path.join(_step_dir(directory, completed_steps), f"rank{rank}.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path!r} is missing; resume from another directory")
    try:
        saved = torch.load(path, weights_only=True)  # never unpickled: tensors and plain containers only
    except Exception as e:  # noqa: BLE001 - torch's message would advise weights_only=False: never for a file
        raise CheckpointError(f"checkpoint file {path!r} is not a checkpoint this runtime wrote "
                              f"({type(e).__name__}); resume from another --checkpoint-dir") from None
    if not (isinstance(saved, dict) and all(isinstance(saved.get(key), dict) for key in ("chunks", "optimizer"))):
        raise CheckpointError(f"checkpoint file {path!r} lacks a rank's chunks and optimizer state; resume from "
                              "another --checkpoint-dir")
    return saved
