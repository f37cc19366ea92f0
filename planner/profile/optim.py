"""The optimizers a run can use, built the same way by the runtime and by `planner profile`
(which times one step of each per unit, so the cost model charges the step the runs take)."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

OPTIMIZERS = ("sgd", "adamw")


def make_optimizer(name: str, params: List[torch.nn.Parameter], lr: float):
    if not params:
        return _NoOptimizer()
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


class _NoOptimizer:
    """A rank without parameters still takes part in every step."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass
