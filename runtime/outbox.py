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


@dataclass
class _Posted:
    works: Sequence[Any]  # torch.distributed Work objects of one batch of sends
    buffers: List[Any]  # the tensors they send: kept alive here until waited for, whatever the backend keeps
    done: List[Optional[Callable[[], None]]]  # run once the sends completed (free what they sent)
    posted_at: float
    delay: float  # emulated transfer seconds of the batch's slowest message


class Outbox:
    def __init__(self) -> None:
        self._posted: List[_Posted] = []

    def add(self, works: Sequence[Any], buffers: List[Any], done: List[Optional[Callable[[], None]]],
            delay: float = 0.0) -> None:
        self._posted.append(_Posted(list(works), list(buffers), done, time.perf_counter(), delay))

    def drain(self) -> None:
        """Wait for every posted send, in posting order, then free what each sent."""
        for posted in self._posted:
            finished = posted.delay > 0 and all(w.is_completed() for w in posted.works)
            for work in posted.works:
                work.wait()
            if posted.delay > 0:
                left = posted.posted_at + posted.delay - time.perf_counter() if finished else posted.delay
                if left > 0:
                    time.sleep(left)
            for done in posted.done:
                if done is not None:
                    done()
        self._posted.clear()
