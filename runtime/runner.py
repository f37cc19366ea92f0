"""What the engine keeps per stage: which values are tensors and carry gradients, the messages'
layouts from the plan, and which storages autograd saves (learned in the first step's forward)."""
from __future__ import annotations

from typing import Any, Optional, Set

import torch

from runtime.comm import MessageLayout, torch_dtype
from runtime.stage import RankStage


def drop_storage(tensor: torch.Tensor) -> None:
    """Keep `tensor` as an autograd endpoint (its shape, dtype and graph) without its data."""
    tensor.data = torch.zeros((), dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)


class StageRunner:
    """Per-stage bookkeeping: which values are tensors, which carry gradients, the messages' layouts,
    and which storages autograd keeps (learned in the first step's forward)."""

    def __init__(self, stage: RankStage):
        self.stage = stage
        self.send_tensors = [i for i, v in enumerate(stage.send) if v["kind"] == "tensor"]
        self.send_grads = [i for i in self.send_tensors if stage.send[i].get("requires_grad")]
        self.recv_tensors = [i for i, v in enumerate(stage.recv) if v["kind"] == "tensor"]
        self.recv_grads = [i for i in self.recv_tensors if stage.recv[i].get("requires_grad")]
        self.wanted_inputs = [stage.model_inputs.index(n) for n in stage.io.inputs]

        def layout(values, indices, what, key="order"):
            return MessageLayout([(tuple(values[j]["shape"]), torch_dtype(values[j]["dtype"])) for j in indices], what,
                                 [values[j].get(key, values[j].get("order")) for j in indices])

        g = stage.index
        self.act_in = layout(stage.recv, self.recv_tensors, f"stage {g}'s input")
        self.act_out = layout(stage.send, self.send_tensors, f"stage {g}'s output")
        # a gradient travels in the order the model's backward lays it out (the profile's grad_order), else the value's
        self.grad_in = layout(stage.send, self.send_grads, f"the gradient of stage {g}'s output", "grad_order")
        self.grad_out = layout(stage.recv, self.recv_grads, f"the gradient of stage {g}'s input", "grad_order")
        # Positions (in `send_tensors` / `recv_tensors` order) whose storage autograd saved; None
        # until learned. A stage with recomputed units reads its inputs again in backward: keep all.
        self.kept_outputs: Optional[Set[int]] = None
        self.kept_inputs: Optional[Set[int]] = None
        self.droppable = not stage.recompute

    def learn_kept(self, state: Any, saved: Set[int]) -> None:
        """After the first forward: which outputs and inputs share a storage autograd saved."""
        def kept(values, indices):
            return {n for n, j in enumerate(indices) if isinstance(values[j], torch.Tensor)
                    and values[j].untyped_storage().data_ptr() in saved}

        if self.kept_inputs is None:
            self.kept_inputs = kept(state.received, self.recv_tensors) if state.received else set()
        if self.kept_outputs is None and state.outputs is not None:
            self.kept_outputs = kept(state.outputs, self.send_tensors)

    def drop_inputs(self, state: Any) -> None:
        """After the forward: received values autograd did not save are kept only as the leaves
        whose .grad the backward fills (without data), or not at all."""
        if not self.droppable or self.kept_inputs is None or not state.received:
            return
        # an input passed on as an output is sent after this: its data stays until then
        passed_on = {o.untyped_storage().data_ptr() for o in (state.outputs or ()) if isinstance(o, torch.Tensor)}
        for n, j in enumerate(self.recv_tensors):
            value = state.received[j]
            if n in self.kept_inputs or value.untyped_storage().data_ptr() in passed_on:
                continue
            if value.requires_grad:
                drop_storage(value)
            else:
                state.received[j] = None

    def drop_outputs(self, state: Any) -> None:
        """After the outputs were sent (or handed over): keep only what the backward needs."""
        if not self.droppable or self.kept_outputs is None or state.outputs is None:
            return
        outputs = list(state.outputs)
        for n, j in enumerate(self.send_tensors):
            value = outputs[j]
            if n in self.kept_outputs:
                continue
            if value.requires_grad and value.grad_fn is not None:
                drop_storage(value)
            elif not value.requires_grad:
                outputs[j] = None
        state.outputs = outputs
