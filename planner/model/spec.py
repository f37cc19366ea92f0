"""What a model entry point returns: a `ModelSpec`, and how its batches are fed to the module.

Entry points (planner.model.entry) return one; the profiler and every rank call the module the
same way (`call_model`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch


@dataclass
class ModelSpec:
    """What to train.

    module: the `torch.nn.Module` to train.
    batch:  `batch(batch_size, step) -> (inputs: tuple, target)`, deterministic for a given step;
            every tensor has the batch on dim 0. `module(*inputs)` is the forward call; if the
            last element of `inputs` is a dict, it holds keyword arguments:
            `module(*inputs[:-1], **inputs[-1])` (see `call_model`). `target` may be any
            tensor, tuple or dict of tensors (or None).
    loss:   `loss(output, target) -> scalar tensor`, the mean loss of a micro-batch; `output`
            is whatever the module returns (tensor, tuple, dict, dataclass such as a Hugging
            Face ModelOutput).
    """

    module: torch.nn.Module
    batch: Callable[[int, int], Tuple[tuple, Any]]
    loss: Callable[[Any, Any], torch.Tensor]


class ModelEntryError(ValueError):
    """The model entry point cannot be resolved or called. The message says how to fix it."""


def call_model(module: torch.nn.Module, inputs: Any) -> Any:
    """The forward call for a batch's `inputs`: a trailing dict is passed as keyword arguments."""
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if inputs and isinstance(inputs[-1], dict):
        return module(*inputs[:-1], **inputs[-1])
    return module(*inputs)


def batch_problem(inputs: Any, target: Any, size: int) -> Optional[str]:
    """What is wrong with a batch of `size` from a `ModelSpec.batch` (None: nothing): its inputs must
    be a tuple (or list) and every tensor in it and in the target needs the batch on dim 0."""
    if not isinstance(inputs, (tuple, list)):
        return f"batch() must return (inputs: tuple, target); inputs was a {type(inputs).__name__}" + \
            (": wrap it, (x,)" if isinstance(inputs, torch.Tensor) else "")

    def walk(obj: Any, what: str) -> Optional[str]:
        if isinstance(obj, torch.Tensor):
            if obj.dim() == 0 or obj.shape[0] != size:
                return f"{what} has shape {tuple(obj.shape)}; every batch tensor needs the batch ({size}) on dim 0"
            return None
        if isinstance(obj, (tuple, list)):
            return next((p for p in (walk(o, f"{what}[{j}]") for j, o in enumerate(obj)) if p), None)
        if isinstance(obj, dict):
            return next((p for p in (walk(v, f"{what}[{k!r}]") for k, v in obj.items()) if p), None)
        return None

    return walk(inputs, "inputs") or walk(target, "target")


def loss_problem(value: Any) -> Optional[str]:
    """What is wrong with a value `ModelSpec.loss` returned (None: nothing): the pipeline starts each
    micro-batch's backward from it, so it must be one number, a tensor that needs a gradient, as
    `loss.backward()` in one process needs it."""
    if not isinstance(value, torch.Tensor):
        return (f"the loss function returned a {type(value).__name__}, not a tensor; fix: return the loss tensor "
                "itself (no float(), .item() or .tolist() on it)")
    if value.numel() != 1:
        return (f"the loss function returned a tensor of shape {tuple(value.shape)}, not one number; fix: return "
                "the micro-batch's mean loss (reduction='mean', or .mean() of per-sample losses)")
    if not value.requires_grad:
        return ("the loss function returned a value that needs no gradient, so no parameter would train (one "
                "process's loss.backward() refuses it too); fix: compute it from the output's floating-point "
                "values, not through detach(), argmax or a comparison")
    return None


def to_device(obj: Any, device: torch.device, copy: bool = False) -> Any:
    """Move every tensor in a (nested) tuple, list or dict to `device`; with `copy`, each into a storage
    of its own (a micro-batch that is a view of the whole batch would keep the whole batch alive, and be
    counted so, while saved for backward: the engine and the profile give each micro-batch its own)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=copy)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device, copy) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device, copy) for k, v in obj.items()}
    return obj


def image_classification(model: torch.nn.Module, image: int, classes: int, seed: int) -> ModelSpec:
    """A spec for a model of (N, 3, image, image) images to `classes` logits: random images and
    labels deterministic per step (`seed` keeps models' streams apart), cross-entropy loss."""
    import torch.nn.functional as F

    def batch(batch_size: int, step: int):
        g = torch.Generator().manual_seed(7919 * step + seed)
        images = torch.randn(batch_size, 3, image, image, generator=g)
        labels = torch.randint(0, classes, (batch_size,), generator=g)
        return (images,), labels

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)

    return ModelSpec(module=model, batch=batch, loss=loss)
