"""A rank's instruction list as the engine runs it: compute actions one at a time, and
communication actions in batches, each batch posted together and waited for as a whole.

The batch rule (the lists', planner.pipeline.messages): a batch is a run of adjacent
communication actions with the same batch id (`Action.batch`); lists without ids (-1) are
batched by adjacency alone.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from planner.pipeline.actions import COMM_KINDS, Action

COMMUNICATION = frozenset(COMM_KINDS)


def _listed_batch(action: Action) -> Optional[int]:
    batch = getattr(action, "batch", None)
    return batch if isinstance(batch, int) and batch >= 0 else None


def batches(actions: Sequence[Action]) -> List[List[int]]:
    """The list's action indices grouped as the engine runs them: a compute action alone, a
    communication batch's actions together (in list order)."""
    groups: List[List[int]] = []
    for k, action in enumerate(actions):
        previous = actions[k - 1] if k else None
        joins = (previous is not None and action.kind in COMMUNICATION and previous.kind in COMMUNICATION
                 and _listed_batch(action) == _listed_batch(previous))
        if joins:
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups


def batch_ids(actions: Sequence[Action]) -> List[Optional[int]]:
    """Each action's batch id (None for compute actions): the list's own, or the batches
    numbered from 0 in list order."""
    ids: List[Optional[int]] = [None] * len(actions)
    number = 0
    for group in batches(actions):
        if actions[group[0]].kind not in COMMUNICATION:
            continue
        listed = _listed_batch(actions[group[0]])
        for k in group:
            ids[k] = listed if listed is not None else number
        number += 1
    return ids


def actions_json(lists: Sequence[Sequence[Action]]) -> Dict[str, Any]:
    """`runtime show --json`: every rank's list, each action as {kind, micro_batch, stage} and
    `batch` on communication actions."""
    ranks = []
    for rank, actions in enumerate(lists):
        entries = []
        for action, batch in zip(actions, batch_ids(actions)):
            entry: Dict[str, Any] = {"kind": action.kind.value, "micro_batch": action.micro_batch,
                                     "stage": action.stage}
            if batch is not None:
                entry["batch"] = batch
            entries.append(entry)
        ranks.append({"rank": rank, "actions": entries})
    return {"ranks": ranks}
