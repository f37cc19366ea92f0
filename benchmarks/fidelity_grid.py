"""What benchmarks/fidelity.py measures: its models (the built-in names, or any model spec
`planner profile` accepts, with its own --model-args) and its schedules (every one the runtime
runs), read from the command line with one-line errors for bad input; and a run's per-rank
compute and waits beside the plan's (what a point off its prediction is read from)."""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Tuple

from planner.model.entry import build_spec, parse_model_args
from planner.model.spec import ModelEntryError
from planner.pipeline.schedule import MULTI_STAGE_SCHEDULES, SCHEDULES, schedule_virtual_stages

MODELS = {
    "gpt": ("builtin:gpt", {"vocab": 8192, "dim": 64, "layers": 4, "seq_len": 32}),
    "resnet": ("builtin:resnet", {"width": 16, "blocks": 4, "image": 32}),
    # not used while the exact model was developed: the held-out pair of the small-micro-batch grid
    "mlp": ("builtin:mlp", {"inputs": 256, "dim": 512, "layers": 8, "outputs": 64}),
    "mobilenet": ("builtin:mobilenet", {"blocks": 6, "width": 0.5, "image": 32}),
}
DEFAULT_MODELS = ("gpt", "resnet")


class ModelOption(argparse.Action):
    """--model SPEC: one more model of the grid; the --model-args after it are its arguments."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.spec_models = list(getattr(namespace, "spec_models", None) or []) + [(value, [])]


class ModelArgOption(argparse.Action):
    """--model-arg KEY=VALUE: an argument of the last --model."""

    def __call__(self, parser, namespace, value, option_string=None):
        models = getattr(namespace, "spec_models", None)
        if not models:
            parser.error(f"--model-arg {value} has no model: give it after the --model it is for "
                         "(e.g. --model hf:BertForMaskedLM --model-arg hidden_size=64)")
        models[-1][1].append(value)


def add_grid_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=None,
                        help=f"comma-separated: of {', '.join(MODELS)}, or model specs without arguments "
                             "(builtin:unet, hf:BertForMaskedLM); default gpt,resnet where no --model is given")
    parser.add_argument("--model", action=ModelOption, metavar="SPEC",
                        help="one more model, as `planner profile` takes it (builtin:NAME, hf:ClassName, "
                             "package.module:function); repeatable, each followed by its own --model-args")
    parser.add_argument("--model-arg", action=ModelArgOption, metavar="KEY=VALUE",
                        help="an argument of the --model before it (as planner profile --model-arg)")
    parser.add_argument("--schedule", default="1f1b",
                        help=f"comma-separated schedules of the plans, of {', '.join(SCHEDULES)} (default 1f1b); "
                             "interleaved and bfs run --virtual-stages stages per rank, zb-v two")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="stages per rank under interleaved and bfs (default 2)")


def _name_of(entry: str) -> str:
    return entry.split(":", 1)[1] if entry.startswith(("builtin:", "hf:")) else entry.rpartition(":")[2]


def grid_models(models, spec_models) -> Dict[str, Tuple[str, Dict[str, Any]]]:
    """{name: (entry, model args)} in order: --models' names and specs (None: the default pair where
    no --model is given), then each --model with its arguments; each spec built once here, so a bad
    one is refused before anything is measured. ValueError (one line) for an unknown name or a model
    that cannot be built."""
    if models is None:
        models = "" if spec_models else ",".join(DEFAULT_MODELS)
    chosen: List[Tuple[str, Dict[str, Any]]] = []
    for item in [m.strip() for m in models.split(",") if m.strip()]:
        if item in MODELS:
            chosen.append(MODELS[item])
        elif ":" in item:
            chosen.append((item, {}))
        else:
            raise ValueError(f"unknown model {item!r}; choose from {', '.join(MODELS)} or give a model spec "
                             "(builtin:NAME, hf:ClassName, package.module:function)")
    for entry, pairs in spec_models or []:
        try:
            chosen.append((entry, parse_model_args(pairs)))
        except ModelEntryError as e:
            raise ValueError(f"--model {entry}: {e}") from None
    if not chosen:
        raise ValueError("no model: give --models or --model")
    named: Dict[str, Tuple[str, Dict[str, Any]]] = {}
    builtin_names = {entry: name for name, (entry, _) in MODELS.items()}
    for entry, args in chosen:
        if (entry, args) in named.values():
            continue
        name = next((n for n, e in MODELS.items() if e == (entry, args)), None) or _name_of(entry)
        if name in named and entry in builtin_names:
            name = _name_of(entry)
        base, k = name, 2
        while name in named:  # one spec with several argument sets
            name, k = f"{base}#{k}", k + 1
        named[name] = (entry, args)
    for name, (entry, args) in named.items():
        try:
            build_spec(entry, args, 0)
        except ModelEntryError as e:
            raise ValueError(str(e)) from None
    return named


def grid_schedules(schedules: str, virtual_stages: int) -> List[str]:
    """The schedules asked for, in order, checked: ValueError (one line) for an unknown one, or
    --virtual-stages below 2 with interleaved or bfs."""
    chosen = list(dict.fromkeys(s.strip() for s in schedules.split(",") if s.strip()))
    if not chosen:
        raise ValueError("--schedule names no schedule")
    for s in chosen:
        if s not in SCHEDULES:
            raise ValueError(f"unknown schedule {s!r}; this runtime runs {', '.join(SCHEDULES)}")
    if virtual_stages < 2 and any(s in MULTI_STAGE_SCHEDULES for s in chosen):
        raise ValueError(f"--virtual-stages must be at least 2 for {', '.join(MULTI_STAGE_SCHEDULES)} "
                         f"(got {virtual_stages})")
    return chosen


def virtual_stages_of(schedule: str, virtual_stages: int) -> int:
    """Stages per rank of a plan under `schedule`: the schedule's own (zb-v 2, one-stage ones 1), else
    --virtual-stages."""
    fixed = schedule_virtual_stages(schedule)
    return virtual_stages if fixed is None else fixed


def rank_lines(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per rank of a run: measured and predicted forward and backward, its wait and idle time (s)."""
    return [{"rank": s["rank"], "chunks": s["chunks"],
             "forward_s": s["measured"]["forward_s"], "predicted_forward_s": s["predicted"]["forward_s"],
             "backward_s": s["measured"]["backward_s"], "predicted_backward_s": s["predicted"]["backward_s"],
             "wait_s": s["measured"]["wait_s"], "idle_s": s["measured"]["idle_s"],
             "optimizer_s": s["measured"]["optimizer_s"]} for s in report.get("stages", [])]

