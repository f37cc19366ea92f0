"""What a message costs a run between computations, measured through the engine's own message path.

`planner profile --link measure` runs this in its two probe processes (runtime.link_probe): each
builds an Engine of a two-stage plan of a tiny model (rank 0 stage 0, rank 1 stage 1) and runs that
plan's 1F1B lists for several steps, every batch of messages through Engine._run_batch as a run
posts it (the message handlers' packing, the post, the wait, the completions' unpacking and
assembling of received values as leaves needing a gradient; a batch of sends only left in flight,
runtime.outbox), and each forward and backward replaced by the same stand-in compute on both ranks
(planner.profile.rhythm's, timed for the model's own stages).

Why: a ping-pong or a loop of batches keeps both processes exchanging back to back, with the
interpreter's and the transport's code and data hot. In a run every message comes after a stage's
compute, and on a CPU host the Python of a post and of a completion then costs several times what
it costs back to back; the runs' messages paid so, the probe's did not (BENCHMARKS.md, "What the
held-out grid's runs paid beyond the plan"). planner.profile.rhythm.rhythm_message_cost reads the
cost per operation from these steps through the step graph of the very lists timed.
"""
from __future__ import annotations

import time
from typing import List

import torch

from planner.pipeline.actions import COMM_KINDS, ActionKind
from planner.profile.rhythm import MICRO_BATCHES, WARMUP_STEPS, StandInCompute, rhythm_step_count

# The model whose cut the engine's messages cross: two units, a (1, 8) activation needing a gradient
MESSAGE_MODEL = ("builtin:mlp", {"inputs": 8, "dim": 8, "layers": 0, "outputs": 8})


def message_engine(rank: int, local, micro_batches: int):
    """This process's Engine of a two-stage 1F1B plan of MESSAGE_MODEL (stage `rank`) with
    `micro_batches` micro-batches of one sample, its messages over `local` (runtime.shared_memory;
    None: gloo) as a run's."""
    from planner.plan.make import plan_for_split
    from planner.profile.measure import profile_model
    from runtime.engine_probe import rank_engine

    profile = profile_model(*MESSAGE_MODEL, [1], threads=0, repeats=1, min_time_s=0.0, whole_model=False)
    plan = plan_for_split(profile, [1], 1, micro_batches)
    engine = rank_engine(plan, plan.topology(), rank, plan.instruction_lists()[rank])
    engine.local = local
    runner = engine.runners[rank]
    runner.kept_outputs, runner.kept_inputs = set(), set()  # as a run knows them after its first forward
    return engine


def engine_rhythm_steps(rank: int, local, forward_s: float, backward_s: float,
                        micro_batches: int = MICRO_BATCHES) -> List[float]:
    """Seconds per step of the two-stage 1F1B lists run through the engine (module docstring) with
    `forward_s` / `backward_s` of stand-in compute per forward / backward, one per timed step, on rank
    0 (rank 1 runs the same call and returns []). What a stand-in forward leaves for the messages
    is what a real one leaves: on rank 0 outputs with a graph behind them, on rank 1 (after its
    backward) the gradients of its inputs. Steps follow each other with no barrier, as a run's do."""
    from runtime.step_state import MicroBatchState, StepState, StepStats

    engine = message_engine(rank, local, micro_batches)
    runner, compute = engine.runners[rank], StandInCompute()
    leaf = torch.zeros(1, requires_grad=True)
    times: List[float] = []
    for n in range(rhythm_step_count(forward_s, backward_s, micro_batches)):
        started = time.perf_counter()
        step = StepState(StepStats(step=n), [], [])
        for group in engine.program:  # the engine's own grouping of its list, as Engine.run_step walks it
            item = engine.actions[group[0]]
            if item.kind in COMM_KINDS:
                engine._run_batch(step, [engine.actions[k] for k in group])
            elif item.kind is ActionKind.FORWARD:
                compute(forward_s)
                state = step.states.setdefault((rank, item.micro_batch), MicroBatchState())
                if rank == 0:
                    outputs: list = [None] * len(runner.stage.send)
                    for j, (shape, dtype) in zip(runner.send_tensors, runner.act_out.tensors):
                        outputs[j] = torch.zeros(shape, dtype=dtype) + leaf.to(dtype)
                    state.outputs = outputs
            elif item.kind is ActionKind.BACKWARD:
                compute(backward_s)
                state = step.states[(rank, item.micro_batch)]
                if rank == 1:
                    state.input_grads = [torch.zeros(shape, dtype=dtype) for shape, dtype in runner.grad_out.tensors]
                    state.input_present = (True,) * len(state.input_grads)
                else:
                    step.states.pop((rank, item.micro_batch))
        engine.outbox.drain()
        if n >= WARMUP_STEPS:
            times.append(time.perf_counter() - started)
    return times if rank == 0 else []
