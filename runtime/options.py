"""The training options `runtime execute` and the worker share: declared once, forwarded to every
rank as the same flags."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from planner.cost.memory import RUN_PRECISIONS, precision_refusal

# "1" in a rank's environment: it ends when the process that started it does (set by runtime.launch,
# read by runtime.worker)
END_WITH_PARENT = "PIPEPLANNER_END_WITH_PARENT"

# How long a rank may wait on another (the process-group timeout) before it fails: the one default of
# `runtime execute --timeout` and of `python -m runtime.worker --timeout` (torchrun launches).
RANK_TIMEOUT_S = 60.0

ENGINES = ("own", "torch")  # runtime/engine.py, runtime/torch_engine.py (torch.distributed.pipelining)
# auto: the engine's messages between CPU ranks of one host go through shared memory (runtime/shared_memory.py),
# and so does the gradient all-reduce of data-parallel replicas all on one host (runtime/shared_reduce.py); the
# others through torch.distributed; gloo: all of them through torch.distributed
P2P = ("auto", "gloo")
P2P_HELP = ("auto (default): messages between the CPU ranks of one host, and the gradient all-reduce of replicas "
            "all on one host, go through shared memory (x86, where /dev/shm has room; else torch.distributed, and "
            "the report says why), the others through torch.distributed; gloo: all through torch.distributed (the "
            "own engine; the torch engine always uses torch.distributed)")
PRECISIONS = RUN_PRECISIONS
DEFAULT_BETAS = (0.9, 0.999)  # torch's Adam and AdamW
SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("sgd", "adam", "adamw")  # what a run steps with (torch.optim's SGD, Adam, AdamW)


@dataclass
class TrainOptions:
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0  # SGD
    weight_decay: Optional[float] = None  # SGD's and Adam's L2 term, AdamW's decoupled decay; None: torch's default
    betas: Tuple[float, float] = DEFAULT_BETAS  # Adam, AdamW
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    total_steps: int = 1
    clip_grad_norm: Optional[float] = None
    precision: str = "fp32"

    def check(self) -> None:
        """ValueError (one line) for options that cannot run."""
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if not 0 < self.lr <= 1e6:  # float32 holds it, and a step can move a weight by a finite amount
            raise ValueError("--lr must be positive, at most 1e6")
        if not (0 <= self.momentum < math.inf and 0 <= (self.weight_decay or 0) < math.inf):
            raise ValueError("--momentum and --weight-decay must be finite numbers, 0 or more")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError("--betas must be two numbers in [0, 1), e.g. 0.9,0.95")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0 or not 0 <= self.min_lr < math.inf:
            raise ValueError("--warmup-steps and --min-lr must be 0 or more (finite)")
        if self.min_lr > self.lr:  # (the cosine would raise the rate from --lr towards it)
            raise ValueError(f"--min-lr {self.min_lr:g} is above --lr {self.lr:g}: the floor the rate decays to; give one "
                             "below --lr")
        if self.optimizer == "sgd" and tuple(self.betas) != DEFAULT_BETAS:  # (they were ignored)
            raise ValueError("--betas are Adam's and AdamW's; this run steps with sgd: give --optimizer adam or adamw, "
                             "or drop --betas")
        if self.optimizer != "sgd" and self.momentum:
            raise ValueError(f"--momentum is SGD's; this run steps with {self.optimizer} (its --betas set its moments): "
                             "drop --momentum, or give --optimizer sgd")
        if self.clip_grad_norm is not None and not 0 < self.clip_grad_norm < math.inf:
            raise ValueError("--clip-grad-norm must be a positive finite number")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}")

    @property
    def decay(self) -> float:
        """The weight decay the optimizer gets: the option, else torch's default for it."""
        if self.weight_decay is not None:
            return self.weight_decay
        return 0.01 if self.optimizer == "adamw" else 0.0

    @property
    def autocast_dtype(self) -> Any:
        """torch.autocast's dtype, or None (fp32)."""
        import torch

        return {"fp32": None, "bf16-mixed": torch.bfloat16}[self.precision]


# (flag, argparse keywords); every one is forwarded from `runtime execute` to the ranks
_OPTIONS = [
    ("--momentum", dict(type=float, default=0.0, help="SGD momentum (default 0)")),
    ("--weight-decay", dict(type=float, default=None,
                            help="SGD and Adam: L2 penalty; AdamW: decoupled decay (default: torch's, 0, 0 and 0.01)")),
    ("--betas", dict(default=",".join(map(str, DEFAULT_BETAS)), metavar="B1,B2",
                      help="Adam and AdamW betas (default 0.9,0.999)")),
    ("--lr-schedule", dict(choices=SCHEDULES, default="constant",
                           help="constant, or cosine from --lr down to --min-lr at the last step (default constant)")),
    ("--warmup-steps", dict(type=int, default=0, help="linear warm-up steps from lr/N to lr (default 0)")),
    ("--min-lr", dict(type=float, default=0.0, help="the cosine schedule's final rate (default 0)")),
    ("--clip-grad-norm", dict(type=float, default=None, metavar="MAX",
                              help="scale gradients so their global norm (all stages and replicas) is at most MAX")),
    ("--precision", dict(choices=PRECISIONS, default=None,
                         help="fp32, or bf16-mixed: one bf16 copy of the weights per step, fp32 master "
                              "parameters and gradients, torch.autocast(bfloat16) around forwards and losses "
                              "(default: the plan's precision; another than the plan's is refused)")),
]


def add_training_options(parser: argparse.ArgumentParser) -> None:
    for flag, keywords in _OPTIONS:
        parser.add_argument(flag, **keywords)


def forwarded(args: argparse.Namespace) -> List[str]:
    """The flags a rank gets for the options given to `runtime execute`."""
    out: List[str] = []
    for flag, _ in _OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    return out


def training_options(args: argparse.Namespace, optimizer: str, plan: Any) -> TrainOptions:
    """The options of a run, checked (ValueError in one line)."""
    try:
        betas = tuple(float(b) for b in str(args.betas).split(","))
    except ValueError:
        raise ValueError(f"--betas {args.betas!r}: write two numbers, e.g. 0.9,0.95") from None
    if len(betas) != 2:
        raise ValueError(f"--betas {args.betas!r}: write two numbers, e.g. 0.9,0.95")
    planned = getattr(plan, "precision", None) or "fp32"
    if precision_refusal(planned):
        raise ValueError(precision_refusal(planned))
    if args.precision is not None and hasattr(plan, "precision_mismatch") and plan.precision_mismatch(args.precision):
        raise ValueError(plan.precision_mismatch(args.precision))
    options = TrainOptions(optimizer=optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                           betas=betas, schedule=args.lr_schedule, warmup_steps=args.warmup_steps, min_lr=args.min_lr,
                           total_steps=args.steps, clip_grad_norm=args.clip_grad_norm,
                           precision=args.precision or planned)
    options.check()
    return options


def run_refusal(plan: Any, options: TrainOptions, checkpointing: bool) -> Optional[str]:
    """Why this plan does not run with these options (one line: cause and fix), or None: checked by
    `runtime execute` before any process starts and by every rank (a torchrun launch)."""
    from runtime.localsgd import run_refusal as local_sgd_refusal

    clipping = options.clip_grad_norm is not None
    refused = local_sgd_refusal(plan.sync_every, options.clip_grad_norm)
    if refused is None and plan.shard == "parameters":
        from runtime.shard_params import refusal as parameters_refusal

        refused = parameters_refusal(options.precision, plan.schedule, plan.topology().replicated, clipping,
                                     checkpointing)
    if refused is None and plan.shard == "gradients" and clipping:
        refused = ("--clip-grad-norm with a plan sharding gradients is not supported: each holder keeps only its "
                   "share of the gradients; re-plan without --shard gradients or drop the clipping")
    return refused
