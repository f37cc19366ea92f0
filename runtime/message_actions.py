"""The engine's communication actions: each send or receive of a stage's activations or gradients as a
point-to-point operation, and what to do once it completed (runtime.engine posts them in batches).
Message layouts are the plan's; under autocast the first activation message between two ranks says its
dtypes, and the first gradient message which inputs got a gradient."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from planner.pipeline.actions import Action
from runtime.comm import (ACTIVATION, GRADIENT, DescribedLayout, MessageError, MessageLayout, Operation,
                          PresenceLayout, message_tag)
from runtime.microbatch import assemble
from runtime.step_state import MicroBatchState, StepState, own_storages


class MessageActions:
    """runtime.engine.Engine's send and receive handlers (a mixin): they read the engine's `runners`,
    `_peer`, `m`, `device` and `autocast`, and keep its `layouts` and `presence` per peer."""

    def _tag(self, receiving_stage: int, micro_batch: int, direction: int) -> int:
        return message_tag(receiving_stage, micro_batch, direction, self.m)

    # Under autocast the plan's dtypes (profiled without it) are not the activations': the first
    # activation message between two ranks describes itself (comm.DescribedLayout) and later ones
    # use the dtypes it carried; gradients have the dtypes of the tensors they belong to.
    def _layout(self, planned: MessageLayout, key: Tuple, tensors: Optional[List[torch.Tensor]] = None):
        if self.autocast is None:
            return planned
        if key not in self.layouts:
            if tensors is None:
                return None
            self.layouts[key] = MessageLayout([(tuple(t.shape), t.dtype) for t in tensors], planned.what,
                                              planned.orders)
        return self.layouts[key]

    def _send_activations(self, step: StepState, action: Action):
        g, i = action.stage, action.micro_batch
        runner, state, peer = self.runners[g], step.states[(g, i)], self._peer(g + 1, i)
        tensors = [state.outputs[j] for j in runner.send_tensors]
        layout = self._layout(runner.act_out, ("act out", g, peer))
        if layout is None:  # the first to this peer: it says its dtypes
            wire, copied = DescribedLayout(runner.act_out).pack(tensors, self.device)
            self._layout(runner.act_out, ("act out", g, peer), tensors)
        else:
            wire, copied = layout.pack(tensors, self.device)
        if copied:  # the outputs' storage can go now, not when the wire is sent
            runner.drop_outputs(state)
            return Operation(True, wire, peer, self._tag(g + 1, i, ACTIVATION)), None
        return (Operation(True, wire, peer, self._tag(g + 1, i, ACTIVATION)),
                lambda _: runner.drop_outputs(state))

    def _receive_activations(self, step: StepState, action: Action):
        g, i = action.stage, action.micro_batch
        runner, peer = self.runners[g], self._peer(g - 1, i)
        layout = self._layout(runner.act_in, ("act in", g, peer))
        described = DescribedLayout(runner.act_in) if layout is None else None

        def arrived(wire: torch.Tensor) -> None:
            if described is not None:
                tensors, self.layouts[("act in", g, peer)] = described.unpack(wire)
            else:
                tensors = layout.unpack(wire)
            step.states.setdefault((g, i), MicroBatchState()).received = assemble(runner.stage, own_storages(tensors))

        buffer = (described or layout).empty(self.device)
        return Operation(False, buffer, peer, self._tag(g, i, ACTIVATION)), arrived

    def _send_gradients(self, step: StepState, action: Action):
        g, i = action.stage, action.micro_batch
        runner, state, peer = self.runners[g], step.states.pop((g, i)), self._peer(g - 1, i)
        key = ("grad out", g, peer)
        layout = self._layout(runner.grad_out, key, state.input_grads)
        known = self.presence.get(key)
        if known is None:  # the first to this peer says which inputs got a gradient (comm.PresenceLayout)
            self.presence[key] = state.input_present
            wire = PresenceLayout(layout).pack(state.input_grads, state.input_present, self.device)
        else:
            if state.input_present != known:
                raise MessageError(
                    f"the gradient of stage {g}'s input: micro-batch {i} has a gradient for inputs "
                    f"{_which(state.input_present)} where the first had one for {_which(known)}; the runtime needs "
                    "the same graph for every micro-batch (as a captured model has)")
            wire, _ = layout.pack(state.input_grads, self.device)
        return Operation(True, wire, peer, self._tag(g - 1, i, GRADIENT)), None

    def _receive_gradients(self, step: StepState, action: Action):
        g, i = action.stage, action.micro_batch
        runner, state, peer = self.runners[g], step.states[(g, i)], self._peer(g + 1, i)
        outputs = [state.outputs[j] for j in runner.send_grads]  # the gradients take their dtypes
        key = ("grad in", g, peer)
        layout = self._layout(runner.grad_in, key, outputs)
        # the first from this peer says which outputs got a gradient; a later receive of the same batch
        # reads the flags in its callback, which runs after this one's (runtime.outbox.completed)
        framed = PresenceLayout(layout) if key not in self.presence else None
        if framed is not None:
            self.presence[key] = None

        def arrived(wire: torch.Tensor) -> None:
            if framed is not None:
                grads, self.presence[key] = framed.unpack(wire)
            else:
                grads = layout.unpack(wire)
            state.grads = [grad if present else None for grad, present in zip(own_storages(grads), self.presence[key])]

        return Operation(False, (framed or layout).empty(self.device), peer, self._tag(g, i, GRADIENT)), arrived


def _which(present: Tuple[bool, ...]) -> str:
    return "[" + ", ".join(str(j) for j, p in enumerate(present) if p) + "]"
