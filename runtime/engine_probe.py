"""What the engine itself costs per forward and per backward: the part of a run's compute that the
profile's unit timings do not see.

A stage's forward in the engine is more than the stage's module: the micro-batch is copied into
storage of its own, the loss is kept for the report, the stage's inputs and outputs are looked
after, the clock is read; a backward seeds the loss with its share of the step, collects the
inputs' gradients and frees the micro-batch: tens of microseconds, several per cent of a small
micro-batch's compute (BENCHMARKS.md, "The engine's own cost per forward and backward").

`engine_overhead` measures it on a null stage: a model of a few microseconds' compute (NULL_MODEL),
profiled, planned as one stage and run by this runtime's Engine (one rank, 1F1B, MICRO_BATCHES
micro-batches a step) in alternation with the same module run bare (forward and loss, then
backward: what the profile times). The overhead per forward (backward) is the median over rounds of
the engine's mean time per micro-batch less the bare stage's in the same round, 0 at least (paired:
a drift of the host's speed meets both sides of a difference alike). `planner profile` records it as
the profile's `engine_overhead_s`, which every stage pays per micro-batch on top of its units
(planner.profile.profile.Profile.stage_overhead), starting this module as a process of its own
(`main`: planner.profile.engine_cost).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from planner.plan.make import plan_for_split
from planner.profile.measure import profile_model
from planner.profile.profile import Profile
from runtime.engine import Engine
from runtime.groups import Groups
from runtime.stage import build_rank

MICRO_BATCHES = 4


# The null stage: a model whose compute is a few microseconds, so that what the engine adds stands out
# of the host's noise (on a real model's milliseconds it does not: measured differences came out
# 0-235 us apart from one run to the next)
NULL_MODEL = ("builtin:mlp", {"inputs": 1, "dim": 1, "layers": 0, "outputs": 1})


def engine_overhead(min_time_s: float = 1.0, min_rounds: int = 30) -> Tuple[float, float]:
    """(forward s, backward s) the engine pays per micro-batch beyond a stage's own work, measured
    on the null stage (CPU, this process's torch threads)."""
    profile = profile_model(*NULL_MODEL, [1], threads=0, repeats=1, min_time_s=0.0, whole_model=False)
    engine, bare = _engine_and_bare(profile, 1)
    for step in range(2):  # the first counts saved bytes, both warm up
        engine.run_step(step)
    bare(1)
    forward_over: List[float] = []  # per round: the engine's mean less the bare stage's mean
    backward_over: List[float] = []
    started, step = time.perf_counter(), 2
    while len(forward_over) < min_rounds or time.perf_counter() - started < min_time_s:
        stats = engine.run_step(step)
        f, g = bare(engine.m)
        forward_over.append(stats.forward_s / engine.m - f)
        backward_over.append(stats.backward_s / engine.m - g)
        step += 1
    return max(0.0, statistics.median(forward_over)), max(0.0, statistics.median(backward_over))


def _engine_and_bare(profile: Profile, b: int) -> Tuple[Engine, Callable[[int], Tuple[float, float]]]:
    """The engine of a one-stage plan of the model at micro-batch size b, and `bare(n)`: n micro-batches
    of the same stage module without it -> their mean (forward and loss s, backward s), as a step
    reports the engine's."""
    device = torch.device("cpu")
    plan = plan_for_split(profile, [], b, b * MICRO_BATCHES)
    topology = plan.topology()
    rank_model = build_rank(plan, topology, 0, device)
    groups = Groups(topology, 0, rank_model.tied_groups)  # one rank, no process group: no reductions
    optimizer = torch.optim.SGD(rank_model.trainable() or [torch.zeros(1, requires_grad=True)], lr=0.0)
    engine = Engine(rank_model, plan.instruction_lists()[0], topology, 0, plan.global_batch, MICRO_BATCHES,
                    optimizer, device, groups)
    stage = rank_model.stages[0]
    runner = engine.runners[stage.index]
    inputs, targets = engine._micro_batches(0)

    def bare(n: int) -> Tuple[float, float]:
        forward = backward = 0.0
        for i in range(n):
            t0 = time.perf_counter()
            args = [inputs[i % len(inputs)][j] for j in runner.wanted_inputs]
            loss = engine.spec.loss(stage.module(*args), targets[i % len(targets)])
            t1 = time.perf_counter()
            if loss.requires_grad:
                torch.autograd.backward(loss)
            t2 = time.perf_counter()
            forward, backward = forward + t1 - t0, backward + t2 - t1
        return forward / n, backward / n

    return engine, bare


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The probe as a process: a JSON config {"threads"}; prints {"forward_s", "backward_s"}."""
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    torch.set_num_threads(max(int(config.get("threads", 1)), 1))
    forward, backward = engine_overhead()
    print(json.dumps({"forward_s": forward, "backward_s": backward}), flush=True)
