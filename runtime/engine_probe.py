"""What the engine itself costs per forward and per backward: the part of a run's compute that the
profile's unit timings do not see.

A stage's forward in the engine is more than the stage's module: the micro-batch is copied into
storage of its own, the loss is kept for the report, the received inputs are taken over and their
storage dropped, the clock is read; a backward seeds the loss with its share of the step, takes the
gradients the next stage left, collects the inputs' gradients and frees the micro-batch: tens of
microseconds, several per cent of a small micro-batch's compute (BENCHMARKS.md, "The engine's own
cost per forward and backward" and "The engine's own cost, measured in a pipeline").

`engine_overhead` measures it where a run pays it: in a pipeline, each action after other work. The
probe model (PROBE_MODEL, a small U-Net, whatever model is profiled) is planned as two stages cut
where its skip connection crosses (two tensors received by the later stage), both stages on one
rank, run by this runtime's Engine (`run_step`, the production path) with the list two ranks' 1F1B
would run in turn: stage 0's forward of micro-batch i, stage 1's forward, stage 1's backward, stage
0's backward (the outputs and the gradients handed over in memory, as the engine does for stages on
one rank). Per compute action, the engine's cost is the step clock's span of the action (what a
run's `forward_s` / `backward_s` count) less the compute inside it: the stage module's call (and the
loss's, on the last stage) for a forward, the `torch.autograd.backward` call for a backward, each
timed by a wrapper around it (PairedTimer). The pair lies inside one action, so the compute's own
noise cancels. Per round (a step): the mean over the step's forwards (backwards), both stages'
alike; the overhead is the median over rounds, 0 at least. The wrappers' own calls (well under a
microsecond each) count as the engine's.

`planner profile` records it as the profile's `engine_overhead_s`, which every stage pays per
micro-batch on top of its units (planner.profile.profile.Profile.stage_overhead), starting this
module as a process of its own (`main`: planner.profile.engine_cost). Measured before on a null
stage run alone in a tight loop, it came out about a third of what a pipeline pays (hot caches, and
a one-stage plan never takes over received tensors).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from planner.pipeline.actions import Action, ActionKind
from planner.pipeline.topology import Topology
from planner.plan.make import plan_for_split
from planner.profile.measure import profile_model
from planner.profile.profile import Profile
from runtime.engine import Engine
from runtime.groups import Groups
from runtime.stage import build_rank

MICRO_BATCHES = 4

# The probe model: a U-Net of one level, whose middle cut carries two tensors (the skip and the
# bottleneck's output) to the later stage, of about 0.3-0.6 ms per action at micro-batch size 1 (compute
# of a small model's stage: what runs between two of the engine's actions and leaves its work cold; a
# much smaller one (width 2, image 4) measured 0.6 of the cost, a larger one (16, 64) 1.5 times: BENCHMARKS.md)
PROBE_MODEL = ("builtin:unet", {"depth": 1, "width": 8, "image": 32, "classes": 2})


def engine_overhead(min_time_s: float = 1.0, min_rounds: int = 30) -> Tuple[float, float]:
    """(forward s, backward s) the engine pays per micro-batch beyond a stage's own compute, measured
    in a two-stage pipeline of the probe model (CPU, this process's torch threads)."""
    return measure(two_stage_engine(), min_time_s, min_rounds)


def probe_cut(profile: Profile) -> int:
    """The cut carrying the most tensors, the middle one of those."""
    counts = {j: sum(v.at(1)["kind"] == "tensor" for v in profile.cut(j).values)
              for j in range(1, len(profile.units))}
    most = [j for j, n in counts.items() if n == max(counts.values())]
    return most[len(most) // 2]


def two_stage_engine(model: Tuple[str, Dict[str, Any]] = PROBE_MODEL) -> Engine:
    """The engine of one rank running both stages of a two-stage plan of `model` (micro-batch size
    1, MICRO_BATCHES micro-batches) in two ranks' 1F1B order, then its optimizer step (learning rate 0)."""
    profile = profile_model(*model, [1], threads=0, repeats=1, min_time_s=0.0, whole_model=False)
    plan = plan_for_split(profile, [probe_cut(profile)], 1, MICRO_BATCHES)
    topology = Topology(num_stages=2, pipeline_ranks=1, virtual_stages=2, data_parallel=1, stage_rank=(0, 0))
    actions = [Action(kind, i, g) for i in range(MICRO_BATCHES)
               for kind, g in ((ActionKind.FORWARD, 0), (ActionKind.FORWARD, 1),
                               (ActionKind.BACKWARD, 1), (ActionKind.BACKWARD, 0))]
    actions.append(Action(ActionKind.OPTIMIZER_STEP))
    return rank_engine(plan, topology, 0, actions)


def rank_engine(plan, topology: Topology, rank: int, actions: List[Action]) -> Engine:
    """The CPU Engine of `rank` running `actions` of `plan` (its micro-batches as the plan has them),
    with an optimizer of learning rate 0: a probe's, whose steps leave the model as it was. Without
    a process group the rank's groups reduce nothing."""
    rank_model = build_rank(plan, topology, rank, torch.device("cpu"))
    groups = Groups(topology, rank, rank_model.tied_groups)
    optimizer = torch.optim.SGD(rank_model.trainable() or [torch.zeros(1, requires_grad=True)], lr=0.0)
    return Engine(rank_model, actions, topology, rank, plan.global_batch, plan.num_micro_batches, optimizer,
                  torch.device("cpu"), groups)


def measure(engine: Engine, min_time_s: float, min_rounds: int) -> Tuple[float, float]:
    """`engine`'s own (forward s, backward s) per compute action: steps until `min_rounds` and
    `min_time_s`, each its actions' clock spans less the compute the PairedTimer saw inside them."""
    timer = PairedTimer()
    with timer.installed(engine):
        for step in range(2):  # the first counts saved bytes, both warm up
            engine.run_step(step)
            timer.take()
        forward_over: List[float] = []  # per round: the mean over the step's forwards
        backward_over: List[float] = []
        started, step = time.perf_counter(), 2
        while len(forward_over) < min_rounds or time.perf_counter() - started < min_time_s:
            engine.run_step(step)
            forward, backward = timer.take()
            forward_over.append(statistics.fmean(forward))
            backward_over.append(statistics.fmean(backward))
            step += 1
    return max(0.0, statistics.median(forward_over)), max(0.0, statistics.median(backward_over))


class PairedTimer:
    """Times the compute inside each of an engine's compute actions (its stages' module calls, the
    loss, `torch.autograd.backward`) and, through the engine's trace hook (`span`), the actions' clock
    spans; `take()` pairs them in run order: ([forward span - its compute], [backward span - its
    compute]) of the step just run."""

    def __init__(self) -> None:
        self.compute: List[List[Any]] = []  # in call order: ["forward" | "backward", seconds]
        self.spans: List[Tuple[str, float]] = []

    def span(self, kind: str, micro_batch: int, stage: int, start: float, end: float) -> None:
        """The engine's trace hook (wall-clock times: a span is exact to about 0.2 us)."""
        if kind in ("forward", "backward"):
            self.spans.append((kind, end - start))

    def timed(self, call: Callable, kind: str, joins: bool = False) -> Callable:
        """`call`, its seconds recorded as a compute of `kind` (`joins`: added to the last one: the
        loss of the module's output)."""
        clock, compute = time.perf_counter, self.compute

        def run(*args, **kwargs):
            t0 = clock()
            out = call(*args, **kwargs)
            seconds = clock() - t0
            if joins:
                compute[-1][1] += seconds
            else:
                compute.append([kind, seconds])
            return out

        return run

    @contextlib.contextmanager
    def installed(self, engine: Engine) -> Iterator[None]:
        """The timers in place on `engine`'s stages, its loss and torch.autograd.backward, and `span` as
        its trace hook (all restored after)."""
        stages = [runner.stage for runner in engine.runners.values()]
        modules, spec, backward, trace = [st.module for st in stages], engine.spec, torch.autograd.backward, engine.trace
        engine.trace = self.span
        for st in stages:
            st.module = self.timed(st.module, "forward")
        engine.spec = dataclasses.replace(spec, loss=self.timed(spec.loss, "forward", joins=True))
        torch.autograd.backward = self.timed(backward, "backward")
        try:
            yield
        finally:
            torch.autograd.backward = backward
            engine.spec, engine.trace = spec, trace
            for st, module in zip(stages, modules):
                st.module = module

    def take(self) -> Tuple[List[float], List[float]]:
        compute, spans = list(self.compute), list(self.spans)
        self.compute.clear()  # in place: the wrappers hold the list
        self.spans.clear()
        if [kind for kind, _ in compute] != [kind for kind, _ in spans]:
            raise RuntimeError("the engine probe's compute calls do not pair with its actions: "
                               f"{[k for k, _ in compute]} against {[k for k, _ in spans]}")
        over: Dict[str, List[float]] = {"forward": [], "backward": []}
        for (kind, inside), (_, span) in zip(compute, spans):
            over[kind].append(span - inside)
        return over["forward"], over["backward"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The probe as a process: a JSON config {"threads"}; prints {"forward_s", "backward_s"}."""
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    torch.set_num_threads(max(int(config.get("threads", 1)), 1))
    forward, backward = engine_overhead()
    print(json.dumps({"forward_s": forward, "backward_s": backward}), flush=True)
