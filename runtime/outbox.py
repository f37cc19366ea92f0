"""Sends posted without waiting: a batch of sends only is posted and the rank goes on computing.

The rule the lists are planned and checked under (planner.pipeline.stepgraph): a batch holding a
receive is posted and waited for whole, since the next compute needs what it receives; a batch of
sends only is posted and left to complete in the background (NCCL completes a send when its
receive is posted; a rank's operations complete in the order it posted them). The rank waits for
its posted sends before its next batch (of any kind) and before the end-of-step work, so later
operations never overtake them and it holds one such batch's buffers at most; a send's buffer
(and the outputs it was packed from) is freed then.

Emulated slow links (runtime.emulation): a send over such a link counts as done `delay` seconds
after it completed. Found complete when the rank comes to wait, it completed at some moment since
it was posted: the rank is held until `delay` after the post at least. Not yet complete, the rank
waits for it and is then held the whole `delay` (the receiver posted just now).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch

from runtime.comm import Operation


@dataclass
class _Posted:
    works: Sequence[Any]  # torch.distributed Work objects of one batch of sends
    operations: List[Operation]  # the sends: their tensors kept alive here until waited for
    after: List[Optional[Callable[[torch.Tensor], None]]]  # per send: run on its tensor once it completed
    posted_at: float
    delay: float  # emulated transfer seconds of the batch's slowest message


def completed(operations: Sequence[Operation], after: Sequence[Optional[Callable[[torch.Tensor], None]]]) -> None:
    """Each completed operation's follow-up, on its tensor (what a send sent, what a receive received)."""
    for operation, done in zip(operations, after):
        if done is not None:
            done(operation.tensor)


class Outbox:
    def __init__(self) -> None:
        self._posted: List[_Posted] = []

    def add(self, works: Sequence[Any], operations: Sequence[Operation],
            after: Sequence[Optional[Callable[[torch.Tensor], None]]], delay: float = 0.0) -> None:
        self._posted.append(_Posted(list(works), list(operations), list(after), time.perf_counter(), delay))

    def drain(self) -> None:
        """Wait for every posted send, in posting order, then run what follows each (free what it sent)."""
        for posted in self._posted:
            finished = posted.delay > 0 and all(w.is_completed() for w in posted.works)
            for work in posted.works:
                work.wait()
            if posted.delay > 0:
                left = posted.posted_at + posted.delay - time.perf_counter() if finished else posted.delay
                if left > 0:
                    time.sleep(left)
            completed(posted.operations, posted.after)
        self._posted.clear()
