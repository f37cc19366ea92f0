"""Built-in models (random weights from configs; no downloads): `builtin:NAME` is module NAME here,
whose `build(**model_args)` returns a ModelSpec; `hf:ClassName` is planner.model.builtin.hf."""

from typing import Optional

BUILTIN_MODELS = ("gpt", "resnet", "mlp", "mobilenet", "unet")


def entry_form_problem(entry: str) -> Optional[str]:
    """What is wrong with a model entry's form (builtin:NAME, hf:CLASS, package.module:function), seen without
    importing anything (the runtime's launcher checks a plan's with it); None where nothing is."""
    kind, sep, name = entry.partition(":")
    if kind == "hf":
        return None
    if kind == "builtin":
        return None if name in BUILTIN_MODELS else \
            f"unknown built-in model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}"
    if not sep or not kind or not name:
        return f"model {entry!r} is not 'builtin:NAME' or 'package.module:function' (built-ins: {', '.join(BUILTIN_MODELS)})"
    return None
