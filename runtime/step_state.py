"""What one step of a rank's list shares (runtime.engine): its statistics, the state of each (stage,
micro-batch) from its forward to its backward, the zero-bubble weight backwards pending; and the
received tensors given storages of their own."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from planner.profile.splitgrad import PendingWeights, own_storage


@dataclass
class StepStats:
    step: int
    time_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0  # in batches of messages: posting, transfer and waiting for the peers
    reduce_s: float = 0.0
    optimizer_s: float = 0.0
    messages: int = 0  # point-to-point operations this rank posted
    loss: Optional[float] = None  # mean over the micro-batches whose loss this rank computed
    loss_count: int = 0


@dataclass
class MicroBatchState:
    """One micro-batch on one stage."""

    received: List[Any] = field(default_factory=list)  # the stage's inputs from the previous stage
    outputs: Any = None  # what it sends on (a tuple), until its backward
    # gradients of those outputs, until backward (None: the output reached no loss, so it has none)
    grads: List[Optional[torch.Tensor]] = field(default_factory=list)
    # of the inputs, until sent or taken (zeros where an input got none; `input_present` says which did)
    input_grads: List[torch.Tensor] = field(default_factory=list)
    input_present: Tuple[bool, ...] = ()
    loss: Optional[torch.Tensor] = None
    saved_bytes: int = 0  # held for backward by this micro-batch's forward
    saved_refs: Optional[list] = None  # what it saved, weakly (a counted step: SavedBytes.saved_refs)


def own_storages(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """Received tensors, each with a storage of its own where the message's buffer holds more (other
    tensors, a header), or, handed over in memory by a stage of the same rank, where it views a larger
    storage: one that autograd saves, or a split backward keeps, then holds only itself."""
    return [own_storage(t) for t in tensors]


@dataclass
class StepState:
    """What one step's actions share: its micro-batches, the micro-batches in flight, the timings."""

    stats: StepStats
    inputs: List[Any]  # per micro-batch, aligned with the graph's placeholders
    targets: List[Any]
    states: Dict[Tuple[int, int], MicroBatchState] = field(default_factory=dict)  # (stage, micro-batch) -> state
    losses: List[torch.Tensor] = field(default_factory=list)  # this rank's micro-batches' losses, detached
    # zero-bubble schedules: (stage, micro-batch) -> (what its weight backward needs, the bytes it still holds)
    weights: Dict[Tuple[int, int], Tuple[Optional[PendingWeights], int]] = field(default_factory=dict)
