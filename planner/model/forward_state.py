"""A loss that reads the model: what forward stored on it, or its parameters.

A model may keep a value on itself in forward (`self.aux = balance_loss`, a mixture of experts' load
balancing term) and its loss function read it (`mse(out, y) + 0.01 * model.aux`). In one process that
trains the balancing term too. In a pipeline the loss runs on the last stage alone, and that rank's
copy of the model never ran the forward that set the attribute: the loss would read a stale value
(or None), and the term's gradient would reach no parameter — another model trained, without a word.

torch.export puts such attributes back after tracing and its graph does not carry them (torch.fx
refuses them: capture then uses export); capture_export records which were written. Every loss the
profile and the runtime compute from the graph's output runs with each of them replaced by a
tripwire: a loss that reads one stops with one line saying what to change. A loss that does not
read them (attention maps kept for plotting) runs as before.

A loss that reads a parameter (`mse(out, y) + lam * model[0].weight.pow(2).sum()`) is refused too
(`state_read_by_loss`, run once by the measured and the analytic profile): the last stage's copy of
another stage's weight is never stepped, and the penalty's gradient would reach no optimizer; and so
is one reading the values of another stage's buffer or frozen weight (class weights registered on
the first layer), which the last rank does not hold (the last unit's own state is the last stage's,
and passes).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from planner.errors import CaptureError
from planner.model.spec import ModelSpec, loss_problem


class _Read(BaseException):
    """The loss touched a tripwire (a BaseException: a loss catching Exception does not swallow it)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


class _Tripwire:
    """Stands for the attribute `path` while the loss runs: any use of it raises `_Read`."""

    def __init__(self, path: str):
        object.__setattr__(self, "_path", path)

    def _read(self, *args: Any, **kwargs: Any) -> Any:
        raise _Read(object.__getattribute__(self, "_path"))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        wires = [a for a in tree_leaves((args, kwargs or {})) if isinstance(a, _Tripwire)]
        raise _Read(object.__getattribute__(wires[0], "_path") if wires else "?")

    def __getattr__(self, name: str) -> Any:
        raise _Read(object.__getattribute__(self, "_path"))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _read
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __matmul__ = __rmatmul__ = _read
    __neg__ = __pos__ = __abs__ = __bool__ = __float__ = __int__ = __index__ = __len__ = __iter__ = _read
    __getitem__ = __lt__ = __le__ = __gt__ = __ge__ = __call__ = _read


def _owner(root: nn.Module, path: str) -> tuple:
    module_path, _, name = path.rpartition(".")
    return (root.get_submodule(module_path) if module_path else root), name


@contextlib.contextmanager
def _tripwires(root: nn.Module, paths: Sequence[str]) -> Iterator[None]:
    saved = []
    for path in paths:
        module, name = _owner(root, path)
        if isinstance(getattr(type(module), name, None), property):  # set through its setter: not a plain slot
            continue
        saved.append((module, name, module.__dict__.get(name, _Tripwire)))
        object.__setattr__(module, name, _Tripwire(path))
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            if value is _Tripwire:
                object.__delattr__(module, name)
            else:
                object.__setattr__(module, name, value)


def guarded_loss(loss: Callable[[Any, Any], Any], root: nn.Module, paths: List[str]) -> Callable[[Any, Any], Any]:
    """`loss` as the pipeline must run it: from the graph's output, with the attributes forward
    writes (`paths`, "block.0.moe.aux") unreadable; `loss` itself when forward writes none."""
    if not paths:
        return loss

    def guarded(output: Any, target: Any) -> Any:
        try:
            with _tripwires(root, paths):
                return loss(output, target)
        except _Read as read:
            name = read.path.rpartition(".")[2]
            raise CaptureError(
                f"the loss function reads the model attribute {read.path!r}, which forward sets (self.{name} = ...): "
                "a pipeline computes the loss on the last stage alone, whose copy of the model did not run that "
                "forward, so it would read a stale value and train another model; return the value from forward "
                "(return out, aux) and take it from the output in the loss") from None

    guarded.__wrapped__ = loss
    return guarded


def pipeline_spec(spec: ModelSpec, forward_sets: List[str]) -> ModelSpec:
    """`spec` with its loss as a pipeline runs it (`guarded_loss` over the attributes forward sets,
    CapturedModel.forward_sets)."""
    return dataclasses.replace(spec, loss=guarded_loss(spec.loss, spec.module, forward_sets))


# what a loss may ask of any tensor: its metadata, which a released (meta) copy keeps
_METADATA = {"__get__", "size", "dim", "__len__", "numel", "stride", "is_floating_point", "is_complex",
             "element_size", "nelement", "ndimension", "is_contiguous"}


class _Reads(TorchFunctionMode):
    """Records which of `watched` (tensor id -> what it is, "buffer 'a.w'") a torch function is given
    the values of."""

    def __init__(self, watched: Dict[int, str]):
        super().__init__()
        self.watched, self.read = watched, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        # a property returning a tensor (.T, .data, .real) hands on the values; .shape or .dtype do not
        if name not in _METADATA or name == "__get__" and isinstance(result, torch.Tensor):
            for leaf in tree_leaves((args, kwargs or {})):
                watched = self.watched.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if watched is not None and watched not in self.read:
                    self.read.append(watched)
        return result


def loss_value_refused(loss: Callable[[Any, Any], Any], output: Any, target: Any) -> None:
    """Refuse (CaptureError, one line) a loss whose value no backward can start from
    (planner.model.spec.loss_problem: a number, a vector, a value that needs no gradient), computed on
    the whole model's `output` (with autograd). The last unit run alone would fail its backward with a
    misleading cause, or pass: its inputs are fresh leaves that need gradients."""
    with torch.enable_grad():
        try:
            value = loss(output, target)
        except CaptureError:
            raise
        except Exception:  # the loss's own failure: the profile's first timed call names it (failures.py)
            return
    problem = loss_problem(value)
    if problem is not None:
        raise CaptureError(problem)


def state_read_by_loss(loss: Callable[[Any, Any], Any], root: nn.Module, output: Any, target: Any,
                       units: Sequence[nn.Module]) -> None:
    """Refuse (CaptureError, one line) a loss that reads the model's state besides `output`, where the
    last stage may not hold it: a trainable parameter its value depends on (the loss on a detached copy
    of the output, differentiated), or the values of a buffer or frozen parameter of a unit (`units`,
    in order; another rank's copy is released). The last unit's own state is the last stage's, and
    state no unit uses stays on every rank: both pass."""
    last = {id(t) for t in list(units[-1].parameters()) + list(units[-1].buffers())} if units else set()
    in_units = {id(t) for unit in units for t in list(unit.parameters()) + list(unit.buffers())}
    named = [(name, p) for name, p in root.named_parameters() if p.requires_grad and id(p) not in last]
    kinds = [(name, t, "buffer") for name, t in root.named_buffers()] + \
        [(name, t, "frozen parameter") for name, t in root.named_parameters()]
    constants = {id(t): f"{kind} {name!r}" for name, t, kind in kinds
                 if not t.requires_grad and id(t) in in_units and id(t) not in last}
    if not named and not constants:
        return
    detached = tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), output)
    reads = _Reads(constants)
    with torch.enable_grad():
        try:
            with reads:
                value = loss(detached, target)
            usable = isinstance(value, torch.Tensor) and value.requires_grad and value.numel() == 1
            grads = torch.autograd.grad(value, [p for _, p in named], allow_unused=True) if usable and named else []
        except CaptureError:
            raise
        except Exception:  # the loss's own failure: the profile's first timed call names it (failures.py)
            return
    read = [name for (name, _), grad in zip(named, grads) if grad is not None]
    if read:
        raise CaptureError(
            f"the loss function reads the model's parameter {read[0]!r}"
            + (f" (and {len(read) - 1} more)" if len(read) > 1 else "")
            + " besides the output (a penalty on the weights?): a pipeline computes the loss on the last stage alone, "
            "whose copy of another stage's weights is never trained, and the term's gradient would reach no "
            "optimizer; add the term in forward (return it with the output, or use the optimizer's weight decay)")
    if reads.read:
        more = f" (and {len(reads.read) - 1} more)" if len(reads.read) > 1 else ""
        raise CaptureError(
            f"the loss function reads the model's {reads.read[0]}{more}, which a layer before the last uses: a "
            "pipeline computes the loss on the last stage alone, which does not hold another stage's state; pass "
            "the tensor to the loss another way (a tensor the loss function keeps, not registered on the model)")
