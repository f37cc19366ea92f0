"""The model entry point: what a user hands the planner and the runtime.

`MODEL` is `builtin:NAME`, `hf:ClassName` or `package.module:function`. The function is called as
`function(**model_args)` and returns a `ModelSpec`. Every rank builds the spec after
`torch.manual_seed(seed)`, so all ranks start from identical weights. Lazy modules (nn.LazyLinear)
get their parameters here, on one forward of the spec's batch (`materialize_lazy`).
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import os
from typing import Any, Callable, Dict, Iterable

import torch

from planner.model.builtin import entry_form_problem
from planner.model.example import remember_batch
from planner.model.lazy import materialize_lazy
from planner.model.spec import ModelEntryError, ModelSpec


def parse_model_args(pairs: Iterable[str]) -> Dict[str, Any]:
    """`["layers=4", "name=x", "tied=True"]` -> `{"layers": 4, "name": "x", "tied": True}`.

    Values are Python int/float/bool literals where they parse as such, else strings.
    """
    args: Dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ModelEntryError(f"--model-arg {pair!r} is not of the form key=value (e.g. --model-arg layers=4)")
        if key in args:  # (the last one won, silently)
            raise ModelEntryError(f"--model-arg {key} is given twice ({args[key]!r} and {_parse_literal(raw.strip())!r}); "
                                  "give it once")
        args[key] = _parse_literal(raw.strip())
    return args


def _parse_literal(raw: str) -> Any:
    if raw in ("true", "false"):
        return raw == "true"
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)  # a config's per-stage sizes: depths=[2,2,6,2]
    return value if isinstance(value, (bool, int, float)) else raw


def resolve_entry(entry: str) -> Callable[..., ModelSpec]:
    problem = entry_form_problem(entry)
    if problem:
        raise ModelEntryError(problem)
    if entry.startswith("hf:"):
        from planner.model.builtin.hf import hf_builder

        return hf_builder(entry.split(":", 1)[1])
    if entry.startswith("builtin:"):
        module = importlib.import_module(f"planner.model.builtin.{entry.split(':', 1)[1]}")
        return module.build
    module_name, _, func_name = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelEntryError(f"cannot import {module_name!r} for model {entry!r}: {e}. "
                              "Is it installed or on PYTHONPATH?") from None
    except SyntaxError as e:
        raise ModelEntryError(f"cannot import {module_name!r} for model {entry!r}: a syntax error in {e.filename}, "
                              f"line {e.lineno}: {e.msg}; fix the module") from None
    except (Exception, SystemExit) as e:  # the module's own code failed (or exited) while importing
        raise ModelEntryError(f"importing {module_name!r} for model {entry!r} raised {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}; fix the module") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ModelEntryError(f"module {module_name!r} has no function {func_name!r}")
    return func


def build_spec(entry: str, args: Dict[str, Any], seed: int) -> ModelSpec:
    """Seed, then call the entry point: the same (entry, args, seed) gives the same weights everywhere."""
    func = resolve_entry(entry)
    if entry.startswith("builtin:"):
        _check_builtin_sizes(entry, func, args)
    torch.manual_seed(seed)
    try:
        spec = func(**args)
    except TypeError as e:
        raise ModelEntryError(f"calling {entry} with {args}: {e}") from None
    except ModelEntryError:  # already says what to do
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the model's own code refused its arguments, or exited
        if os.environ.get("PLANNER_TRACEBACK"):  # (PLANNER_TRACEBACK=1: where)
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        raise ModelEntryError(f"building {entry} with {args} failed: {type(e).__name__}: {first}; check the model "
                              "arguments (--model-arg)") from None
    if not isinstance(spec, ModelSpec):
        raise ModelEntryError(f"{entry} returned {type(spec).__name__}, expected planner.ModelSpec(module=, batch=, loss=)")
    if not isinstance(spec.module, torch.nn.Module):
        raise ModelEntryError(f"{entry}: ModelSpec.module must be a torch.nn.Module")
    spec.batch, spec.loss = _batch_errors_in_one_line(spec.batch), _loss_exit_raises(spec.loss)
    materialize_lazy(spec, entry)
    remember_batch(spec.module, spec.batch)  # torch.export captures on an example batch
    return spec


class ModelExit(RuntimeError):
    """The model's loss function called sys.exit."""


def _loss_exit_raises(loss: Callable) -> Callable:
    """`loss`, with a SystemExit it raises turned into an error that the profile reports with the
    unit (the loss's other errors already are) and a rank with its step, not a silent exit."""
    @functools.wraps(loss)
    def call(*args, **kwargs):
        try:
            return loss(*args, **kwargs)
        except SystemExit as e:
            raise ModelExit(f"the model's loss function called sys.exit({e.code!r})") from None
    return call


def _batch_errors_in_one_line(batch: Callable) -> Callable:
    """`batch`, with what it raises (an error, or sys.exit) as a one-line ModelEntryError: it is
    called from a dozen places (capture, profile, ranks), none of which can do more with it."""
    @functools.wraps(batch)
    def call(*args, **kwargs):
        try:
            pair = batch(*args, **kwargs)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the model's own code, whatever it raised
            if os.environ.get("PLANNER_TRACEBACK") and not isinstance(e, SystemExit):
                raise
            what = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else \
                f"raised {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            raise ModelEntryError(f"the model's batch function {what} (batch size {args[0] if args else '?'}, step "
                                  f"{args[1] if len(args) > 1 else '?'}); fix it (PLANNER_TRACEBACK=1 shows the stack)"
                                  ) from None
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):  # every caller unpacks it (a traceback before)
            got = f"a {type(pair).__name__} of {len(pair)}" if isinstance(pair, (tuple, list)) else \
                type(pair).__name__
            raise ModelEntryError(f"the model's batch function returned {got}, not the pair (inputs, target); fix it: "
                                  "return e.g. ((x,), y) (ModelSpec.batch)")
        return pair
    return call


MAX_BUILTIN_SIZE = 1 << 20  # a built-in model's integer argument (layers, width, vocabulary): beyond, a typo


def _check_builtin_sizes(entry: str, func: Callable[..., ModelSpec], args: Dict[str, Any]) -> None:
    """A built-in model's integer arguments are sizes and counts: 0 to MAX_BUILTIN_SIZE (layers=-1 built
    a model without layers, layers=10**22 never finished building; layers=0 is the engine probe's null
    stage)."""
    parameters = inspect.signature(func).parameters
    for name, value in args.items():
        annotation = parameters[name].annotation if name in parameters else None
        if annotation in (int, "int") and isinstance(value, int) and not isinstance(value, bool) and \
                not 0 <= value <= MAX_BUILTIN_SIZE:
            raise ModelEntryError(f"{entry}: {name}={value} is a size, 0 to {MAX_BUILTIN_SIZE}")


def model_name(entry: str) -> str:
    """A short name for file names: 'builtin:gpt' -> 'gpt', 'pkg.mod:make_net' -> 'make_net'."""
    return entry.rsplit(":", 1)[-1].replace(".", "_") or "model"
