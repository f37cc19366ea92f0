"""A bf16-mixed run's units, for a profile measured as such a run (`planner profile --precision
bf16-mixed`): the modules compute with the runtime's own bf16 weight copies under autocast, so what
autograd saves, what crosses the cuts and the times are those of `runtime execute` at bf16-mixed."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

import torch


class MixedRun:
    """The units run as a bf16-mixed rank runs its stages (planner.model.precision, runtime.engine): the
    modules compute with one bf16 copy of each weight (planner.model.precision.ComputeCopy, with its
    graph rules), installed for the whole measurement as the engine installs it for a step (the
    cast is in no unit's time and no saved byte), every forward and loss runs under
    torch.autocast(bfloat16), every backward outside it; a split backward computes the gradients of
    the fp32 masters, as the engine lists them. What autograd saves, what crosses the cuts and the
    times are then a bf16-mixed run's."""

    dtype = torch.bfloat16

    def __init__(self, modules: Sequence[torch.nn.Module], device: torch.device):
        from planner.model.precision import ComputeCopy  # the run's own definition of the copies

        self.device_type = device.type
        # each module's trainable parameters, taken before any copy is installed: the fp32 masters,
        # as the engine takes its stages' (runtime.engine's stage_params)
        self._trainable: Dict[int, List[torch.Tensor]] = {
            id(module): [p for p in module.parameters() if p.requires_grad] for module in modules}
        self.copy = ComputeCopy(modules, self.dtype)
        for module in modules:
            module.forward = self._under_autocast(module)
            module.zero_grad = self._zero_grad(module)  # the masters' (a copy's .grad is no gradient)

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype)

    def _under_autocast(self, module: torch.nn.Module) -> Callable[..., Any]:
        def forward(*args, **kwargs):  # the class's forward, read when called (a recompiled graph's)
            # each argument as the run's stage reads it (runtime.engine's `_as_computed`): a leaf needing a
            # gradient through a view, so autocast casts it once per reader as it does a computed value,
            # not once for all (its cache of leaves): T5's decoder blocks saved one bf16 copy of the encoder
            # output where the run saves one for k and one for v
            args = tuple(a.view_as(a) if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad else a
                         for a in args)
            with self.autocast():
                return type(module).forward(module, *args, **kwargs)
        return forward

    def _zero_grad(self, module: torch.nn.Module) -> Callable[..., None]:
        def zero_grad(set_to_none: bool = True) -> None:
            for p in self.trainable(module):
                p.grad = None
        return zero_grad

    def loss(self, loss: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def under_autocast(output, target):
            with self.autocast():
                return loss(output, target)
        return under_autocast

    def install(self) -> None:
        self.copy.install()

    def remove(self) -> None:
        self.copy.remove()

    def trainable(self, module: torch.nn.Module) -> List[torch.Tensor]:
        """The module's trainable parameters as the engine lists them: the masters, each once."""
        return self._trainable[id(module)]
