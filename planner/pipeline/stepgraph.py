"""One training step as a graph of the lists the runtime executes: its time, and what each rank holds.

Semantics (the runtime's own, the same on gloo and NCCL):

- Each pipeline rank runs its list in order. A forward or backward of stage g takes
  `forward[g]` / `backward[g]` seconds; zero-bubble lists' input and weight backwards take
  `backward_input[g]` / `backward_weight[g]`.
- Communication actions with the same batch id are one batch (they stand together in a list). A
  rank that reaches a batch posts all of its operations at once and waits until every one is done.
  An operation is done once the peer has posted the matching operation too and the message has
  crossed: done = max(post, peer's post) + transfer. The batch ends when its last operation is
  done, plus `message` seconds per operation (what the engine pays per message).
- Except a batch of sends only: the rank pays `message` per send to post it and goes on (its next
  compute does not need it). Each such send is done at max(post, receiver's post) + transfer. The
  rank's next batch and its end of step wait for them first (so a rank's operations complete in
  issue order, as on NCCL's stream, and it holds one such batch's buffers at most).
- After its list a rank synchronises: the collectives it takes part in, in one order on every rank
  (the tied weights' all-reduces by name, then a replicated stage's all-reduce over its replicas:
  each starts when its last member is ready), the all-reduce of its own gradients over the
  data-parallel replicas (all alike, so it waits for no one), then its optimizer step.

The step time is when the last rank finishes. Each node's end is the latest of its predecessors'
ends (plus an edge's transfer) plus its own duration, so the step time is the longest path through
a graph fixed by the lists alone, and its length is a sum of durations. `Timeline.critical` counts
the duration terms on that path: a linear function of the durations that equals the step time here
and, the path existing whatever the durations, bounds the step time from below for any others.

Duration terms: ("forward", g), ("backward", g), ("backward_input", g), ("backward_weight", g), ("act", g) and ("grad", g) (a message across
boundary g, between stages g and g + 1), ("message",), a collective's own term (("tie", name), ("lanes", g)), ("reduce", rank),
("step", rank).
"""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from planner.pipeline.actions import BACKWARD_KINDS, COMM_KINDS, COMPUTE_KINDS, SENDS, Action, ActionKind, message_of
from planner.pipeline.messages import produced_message

Term = Tuple
Position = Callable[[int, int], int]  # (stage, micro-batch) -> pipeline rank



class DeadlockError(ValueError):
    pass


@dataclass
class _Node:
    preds: List[Tuple[int, Optional[Term]]]  # (node whose end this waits for, -1 = time 0; edge term or None)
    terms: List[Term]  # own duration: the sum of these
    rank: int  # -1 for a collective of several ranks
    label: str
    action: Optional[Action] = None  # the list's action (a batch's first) this node stands for


@dataclass
class Timeline:
    step_s: float
    rank_end_s: List[float]
    critical: Counter  # term -> how many times it lies on the longest path
    # collectives the longest path passes through from one rank to another: (term, from, to)
    crossings: List[Tuple[Term, int, int]] = field(default_factory=list)
    node_end_s: List[float] = field(default_factory=list)


def batches_of(actions: Sequence[Action]) -> List[object]:
    """The list with each batch of communication actions as one tuple, without the optimizer step."""
    out: List[object] = []
    for a in actions:
        if a.kind in COMM_KINDS:
            if out and isinstance(out[-1], tuple) and out[-1][0].batch == a.batch:
                out[-1] = out[-1] + (a,)
            else:
                out.append((a,))
        elif a.kind != ActionKind.OPTIMIZER_STEP:
            out.append(a)
    return out


class StepGraph:
    """The lists compiled into nodes (computes, batches, collectives, end-of-step work) in an order
    where every node comes after its predecessors. `position(stage, micro_batch)` is the rank running
    an action (to find a message's peer); `collectives` are (term, member ranks) in the order every
    rank runs them. Raises DeadlockError when the lists cannot all finish, naming where they wait."""

    def __init__(self, lists: Sequence[Sequence[Action]], position: Position,
                 collectives: Sequence[Tuple[Term, Sequence[int]]] = ()):
        self.nodes: List[_Node] = []
        self.ranks = len(lists)
        items = [batches_of(actions) for actions in lists]
        cursor = [0] * self.ranks
        last = [-1] * self.ranks
        # (message, is send) -> the node whose end is when that end is ready to match: its post,
        # or the completion of what its rank posted before (operations complete in issue order)
        ready: Dict[Tuple[Tuple[str, int, int], bool], int] = {}
        # per rank: the messages of its batch of deferred sends not yet known complete (one at most)
        pending: List[Optional[List[Tuple[str, int, int]]]] = [None] * self.ranks
        done: List[int] = [-1] * self.ranks  # the node where the rank's last resolved sends completed
        progress = True
        while progress:
            progress = False
            for r in range(self.ranks):
                if self._settle(r, pending, ready, done):
                    progress = True
                while cursor[r] < len(items[r]):
                    item = items[r][cursor[r]]
                    if isinstance(item, tuple) and all(a.kind in SENDS for a in item) and pending[r] is None:
                        last[r], done[r] = self._after(r, last[r], done[r]), -1  # once the sends before completed
                        pending[r] = [message_of(a) for a in item]
                        for message in pending[r]:
                            ready[(message, True)] = last[r]
                        node = self._add([(last[r], None)], [("message",)] * len(item), r,
                                         "post " + ", ".join(str(a) for a in item), item[0])
                        self._settle(r, pending, ready, done)
                    elif pending[r] is not None:
                        break  # a deferred send's receiver has not posted yet
                    elif isinstance(item, tuple):
                        last[r], done[r] = self._after(r, last[r], done[r]), -1  # in issue order: sends first
                        node = self._batch(r, item, last[r], ready)
                        if node is None:
                            break
                    else:
                        node = self._add([(last[r], None)], [(item.kind.value, item.stage)], r, str(item), item)
                    last[r] = node
                    cursor[r] += 1
                    progress = True
        waiting = {r: items[r][cursor[r]] for r in range(self.ranks) if cursor[r] < len(items[r])}
        unsent = {r: pending[r][0] for r in range(self.ranks) if pending[r] is not None}
        if waiting or unsent:
            raise DeadlockError("the lists deadlock: " + "; ".join(
                [f"rank {r} waits at batch [{', '.join(str(a) for a in item)}]" if isinstance(item, tuple)
                 else f"rank {r} waits at {item} for its sends to complete" for r, item in waiting.items()]
                + [f"rank {r}'s send of {m} is never received" for r, m in unsent.items() if r not in waiting]))
        for r in range(self.ranks):
            last[r] = self._after(r, last[r], done[r])
        for term, members in collectives:
            node = self._add([(last[r], None) for r in members], [term], -1, str(term))
            for r in members:
                last[r] = node
        self.rank_last: List[int] = []
        for r in range(self.ranks):
            node = self._add([(last[r], None)], [("reduce", r)], r, "reduce")
            self.rank_last.append(self._add([(node, None)], [("step", r)], r, ActionKind.OPTIMIZER_STEP.value))
        # the nodes as integer arrays (term indices; -1: none): `run` is a tight loop over them
        index: Dict[Term, int] = {}
        self._preds = [tuple((p, index.setdefault(term, len(index)) if term is not None else -1)
                             for p, term in node.preds) for node in self.nodes]
        self._own = [tuple(index.setdefault(term, len(index)) for term in node.terms) for node in self.nodes]
        self._terms = list(index)

    def _add(self, preds, terms, rank: int, label: str, action: Optional[Action] = None) -> int:
        self.nodes.append(_Node(preds, terms, rank, label, action))
        return len(self.nodes) - 1

    def _after(self, r: int, before: int, completed: int) -> int:
        """The node where rank r, past `before`, also has the sends it posted completed at `completed`
        (-1: none pending). Its caller then clears `completed`: later nodes follow this one."""
        if completed < 0 or completed == before:
            return before
        return self._add([(before, None), (completed, None)], [], r, "sends complete")

    def _settle(self, r: int, pending, ready, done: List[int]) -> bool:
        """Rank r's deferred sends, once every receive is posted: each is done when its receive is
        posted too and it has crossed; `done[r]` then stands for all of them. True if resolved now."""
        messages = pending[r]
        if messages is None:
            return False
        peers = [ready.get((message, False)) for message in messages]
        if any(peer is None for peer in peers):
            return False
        ends = [self._add([(ready[(message, True)], message[:2]), (peer, message[:2])], [], r, f"sent {message}")
                for message, peer in zip(messages, peers)]
        done[r] = ends[0] if len(ends) == 1 else self._add([(e, None) for e in ends], [], r, "sent")
        pending[r] = None
        return True

    def _batch(self, r: int, batch: Tuple[Action, ...], before: int, ready) -> Optional[int]:
        """The node of a batch once every operation's peer is ready; None while one is not."""
        for a in batch:
            ready.setdefault((message_of(a), a.kind in SENDS), before)
        preds: List[Tuple[int, Optional[Term]]] = []
        for a in batch:
            message = message_of(a)
            peer = ready.get((message, a.kind not in SENDS))
            if peer is None:
                return None
            transfer = message[:2]
            preds += [(before, transfer), (peer, transfer)]
        return self._add(preds, [("message",)] * len(batch), r, "batch " + ", ".join(str(a) for a in batch), batch[0])

    def run(self, value: Mapping[Term, float]) -> Timeline:
        """Every node's end for one set of durations (`value[term]`, 0 where absent)."""
        terms, all_preds, all_own = self._terms, self._preds, self._own
        val = [float(value.get(term, 0.0)) for term in terms] + [0.0]  # index -1: no term
        end = [0.0] * (len(self.nodes) + 1)  # end[-1] = 0: the start of the step
        via: List[Tuple[int, int]] = [(-1, -1)] * len(self.nodes)
        for n in range(len(self.nodes)):
            best, arg = 0.0, (-1, -1)
            for p, t in all_preds[n]:
                x = end[p] + val[t]
                if x > best:
                    best, arg = x, (p, t)
            for t in all_own[n]:
                best += val[t]
            end[n], via[n] = best, arg
        end.pop()
        timeline = self.timeline(end, via.__getitem__)
        timeline.node_end_s = end
        return timeline

    # The compiled graph, read by planner.cost.step's vectorised runner: per node, its predecessors
    # as (node or -1, edge term index or -1) and its own term indices; the terms by index.
    @property
    def predecessors(self) -> List[Tuple[Tuple[int, int], ...]]:
        return self._preds

    @property
    def own_terms(self) -> List[Tuple[int, ...]]:
        return self._own

    @property
    def terms(self) -> List[Term]:
        return self._terms

    def timeline(self, end: Sequence[float], via: Callable[[int], Tuple[int, int]]) -> Timeline:
        """The Timeline of node ends `end` (no node ends) whose longest path enters node n from
        `via(n)` = (predecessor or -1, edge term index or -1): the step, each rank's end, and the
        path's term counts and collective crossings, traced back from the last rank to finish."""
        rank_end = [float(end[n]) for n in self.rank_last]
        n = max(self.rank_last, key=lambda k: end[k])
        on_path: List[Term] = []
        crossings: List[Tuple[Term, int, int]] = []
        after = -1  # the rank of the path's node after n
        while n >= 0:
            node = self.nodes[n]
            on_path += node.terms
            p, t = via(n)
            if t >= 0:
                on_path.append(self._terms[t])
            if node.rank < 0 and p >= 0 and self.nodes[p].rank != after:
                crossings.append((node.terms[0], self.nodes[p].rank, after))
            after = node.rank if node.rank >= 0 else after
            n = p
        return Timeline(step_s=max(rank_end), rank_end_s=rank_end, critical=Counter(on_path), crossings=crossings)


def held_peaks(actions: Sequence[Action]) -> List[Dict[Term, int]]:
    """What one rank's list holds at its fullest moments, as counts per stage (Pareto-maximal over
    the list's positions: no returned vector is covered by another):

    ("live", g)   micro-batches of stage g forwarded and not yet backwarded (their saved tensors);
    ("inbox", g)  activations received for stage g and not yet consumed by its forward;
    ("gradbox", g) gradients received for stage g and not yet consumed by its backward;
    ("weight", g) micro-batches of stage g past their input backward and before their weight
                  backward (what the weight gradients still need);
    ("sent_act", g) / ("sent_grad", g) stage g's outputs (the gradients of its inputs) posted in a
                  batch of sends only and not yet waited for: they are held until the rank's next
                  batch (a send in a batch with receives is done before the next compute); and those
                  whose send comes only after a later compute (planner.pipeline.pulled), held from
                  that compute on until their send is done.

    Memory at a moment is the sum of count x bytes per micro-batch of each term, so the peak memory
    of any sizes is the largest of these vectors' sums."""
    counts: Counter = Counter()
    peaks: List[Dict[Term, int]] = []

    def record() -> None:
        snapshot = {k: v for k, v in counts.items() if v}
        if any(all(p.get(k, 0) >= v for k, v in snapshot.items()) for p in peaks):
            return
        peaks[:] = [p for p in peaks if not all(snapshot.get(k, 0) >= v for k, v in p.items())]
        peaks.append(snapshot)

    sent = {message_of(a): _sent_term(a) for a in actions if a.kind in SENDS}  # message -> its held term
    posted: List[Term] = []  # the terms of the last batch of sends only, until the next batch waits for it
    fresh: List[Tuple] = []  # (message, term) made by the last compute and not yet posted
    unsent: Dict[Tuple, Term] = {}  # message -> term: made before the last compute, not yet posted
    for item in batches_of(actions):
        if isinstance(item, tuple):
            for term in posted:  # the sends of the batch before are waited for first (runtime.engine
                counts[term] -= 1  # drains them before it makes this batch's buffers)
            posted = []
            only_sends = all(a.kind in SENDS for a in item)
            done: List[Term] = []  # held sends this batch completes before the next compute
            in_batch = [message_of(a) for a in item]
            for a, message in zip(item, in_batch):
                if a.kind not in SENDS:
                    continue
                term = sent[message]
                if message in unsent:  # already counted since a later compute
                    del unsent[message]
                    (posted if only_sends else done).append(term)
                elif only_sends:
                    counts[term] += 1
                    posted.append(term)
            fresh = [(m, t) for m, t in fresh if m not in in_batch]
        for a in (item if isinstance(item, tuple) else (item,)):
            if a.kind in COMPUTE_KINDS:
                for message, term in fresh:  # a compute runs before their send: they are held
                    unsent[message] = term
                    counts[term] += 1
                fresh = []
            _hold(a, counts, record)
            made = produced_message(a, sys.maxsize)  # one no send carries (the last stage's output) is not in `sent`
            if made in sent:
                fresh.append((made, sent[made]))
        if isinstance(item, tuple):
            for term in done:
                counts[term] -= 1
            record()  # what arrived and what was posted, held while the next compute starts
    return peaks


def _sent_term(send: Action) -> Term:
    return ("sent_act" if send.kind is ActionKind.SEND_ACT else "sent_grad", send.stage)


def _hold(a: Action, counts: Counter, record: Callable[[], None]) -> None:
    """Count what action `a` makes its rank hold (held_peaks), recording the peaks around it."""
    g = a.stage
    if a.kind == ActionKind.RECV_ACT:
        counts[("inbox", g)] += 1
    elif a.kind == ActionKind.RECV_GRAD:
        counts[("gradbox", g)] += 1
    elif a.kind == ActionKind.FORWARD:
        counts[("live", g)] += 1
        if counts[("inbox", g)]:
            counts[("inbox", g)] -= 1
    elif a.kind in BACKWARD_KINDS:
        record()  # the backward runs while all of it is held
        counts[("live", g)] -= 1
        if a.kind is ActionKind.BACKWARD_INPUT:
            counts[("weight", g)] += 1
        if counts[("gradbox", g)]:
            counts[("gradbox", g)] -= 1
    elif a.kind is ActionKind.BACKWARD_WEIGHT:
        record()
        counts[("weight", g)] -= 1
        return
    else:
        return
    record()
