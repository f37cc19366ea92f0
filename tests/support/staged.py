"""A plan's stages run in this test process: many cut positions checked in the time one
multi-process run takes.

Each pipeline rank is built by the runtime's own `build_rank` (its own copy of the model, its
chunks cut from the graph the way a rank cuts them) and driven by the runtime's own `Engine`
forward, backward and receive-assembly steps; only the transport is this file's: a value crossing
a cut is handed over as a fresh tensor, as a receive makes it, and a gradient as the tensor a
receive would fill; the sender then drops its outputs' storage as a completed send does. Micro-batches run GPipe's order (every stage forwards the micro-batches in
order, as every schedule does, so buffers see the same updates); one SGD step per rank ends a
step. Schedules, transport and processes are what tests/support/runs.execute checks."""
from __future__ import annotations

from typing import Dict, List

import torch

from planner.pipeline.schedule import Action, ActionKind
from planner.plan.file import Plan
from planner.profile.optim import make_optimizer
from runtime.engine import Engine, StepStats, MicroBatchState, StepState
from runtime.microbatch import assemble
from runtime.groups import Groups
from runtime.stage import build_rank, stage_state


def run_in_process(plan: Plan, steps: int = 3, lr: float = 0.05) -> Dict[str, torch.Tensor]:
    """The model's state_dict (parameters and buffers) after `steps` steps of `plan` (one stage per
    rank, no data parallelism, no weight tied across stages), as `runtime execute --save-state`
    would save it."""
    topology = plan.topology()
    assert topology.data_parallel == 1 and topology.pipeline_ranks == len(plan.stages), "one stage per rank"
    m, g = plan.num_micro_batches, plan.global_batch
    device = torch.device("cpu")
    engines: List[Engine] = []
    for rank in range(topology.pipeline_ranks):
        model = build_rank(plan, topology, rank)
        assert not model.tied_groups, "weights tied across stages need the runtime's gradient all-reduce"
        optimizer = make_optimizer("sgd", model.parameters(), lr)
        engines.append(Engine(model, [], topology, rank, g, m, optimizer, device,
                              Groups(topology, rank, model.tied_groups)))
    runners = [next(iter(e.runners.values())) for e in engines]
    for step in range(steps):
        micro_inputs, micro_targets = engines[0]._micro_batches(step)
        steps_of = [StepState(StepStats(step=step), micro_inputs, micro_targets)
                    for _ in engines]
        for i in range(m):
            for s, (engine, runner) in enumerate(zip(engines, runners)):
                if s > 0:
                    sent = steps_of[s - 1].states[(s - 1, i)].outputs
                    fresh = [sent[j].detach().clone() for j in runners[s - 1].send_tensors]
                    # sent: the engine now drops what autograd did not save (a send's completion does this)
                    runners[s - 1].drop_outputs(steps_of[s - 1].states[(s - 1, i)])
                    steps_of[s].states[(s, i)] = MicroBatchState(received=assemble(runner.stage, fresh))
                engine._forward(steps_of[s], Action(ActionKind.FORWARD, i, s))
        for i in range(m):
            for s in reversed(range(len(engines))):
                if s < len(engines) - 1:
                    done = steps_of[s + 1].states.pop((s + 1, i))  # its backward left the gradients
                    steps_of[s].states[(s, i)].grads = [grad.clone() if present else None for grad, present
                                                        in zip(done.input_grads, done.input_present)]
                engines[s]._backward(steps_of[s], Action(ActionKind.BACKWARD, i, s))
        for engine in engines:
            engine.optimizer.step()
            engine.optimizer.zero_grad(set_to_none=True)
    state: Dict[str, torch.Tensor] = {}
    for engine in engines:
        for st in engine.rank_model.stages:
            state.update(stage_state(st, engine.rank_model.spec))
    return state
