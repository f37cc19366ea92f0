"""What a device holds besides activations, and what data parallelism sends: bytes per parameter by
precision, optimizer and sharding, the data-parallel traffic per iteration, and the per-device reserve.

Bytes per parameter before sharding (`bytes_per_param`, n = 1):

    precision    params  compute copy  grads  master  optimizer (per moment; AdamW: 2 moments, SGD: 0)
    fp32            4         0          4      0      4
    bf16-mixed      4         2          4      0      4     fp32 parameters are the master weights;
                                                           the runtime casts the bf16 copy once a step
    bf16            2         0          2      0      2     pure bf16: state in bf16 too

So AdamW holds 16 B (fp32), 18 B (bf16-mixed) and 8 B (bf16) per parameter; SGD (no momentum)
8, 10 and 4. The bf16-mixed compute copy is held once per stage, for the whole step, not per
micro-batch: the runtime casts each weight to bf16 once at the step's start and every forward and
backward of the step computes with that copy, accumulating each micro-batch's gradient into the fp32
master's in fp32 (planner/model/precision.py; a copy per micro-batch in flight, 1.58 B per parameter per
micro-batch on an H200, was what one autocast region per forward held: BENCHMARKS.md, "LLM
scale"). One-dimensional parameters (biases, normalisation weights) are not copied: the count is
2 B high for them, a negligible share. 4 + 2 + 4 + 8 = 18 B is also what Megatron-LM holds in bf16
(2 B bf16 weights, 4 B fp32 main weights, 4 B fp32 gradients, 8 B Adam moments); the difference is
which part ZeRO-1 can shard: here the fp32 weights are the model's own parameters (each holder
casts its copy from them), so only the optimizer state shards.

Frozen parameters (requires_grad=False: a fine-tune's base weights) have no gradient, no master
weights and no optimizer state: a device keeps the `params` column (and the compute copy) for every
parameter, the other three for trainable ones only (`ParamBytes.weights`, `ParamBytes.training`).
A LoRA fine-tune of an fp32 model under AdamW holds 4 B per frozen parameter, 16 B per adapter one.

Sharding across the n holders of a stage (its d data-parallel replicas), ZeRO's stages:

    none        nothing sharded
    optimizer   master + optimizer state / n                                 (ZeRO-1)
    gradients   ... and gradients / n                                        (ZeRO-2)
    parameters  ... and parameters / n, the compute copy made per unit when   (ZeRO-3, FSDP)
                it is gathered; each device also holds the gathered parameters of two units
                (the one running and the one prefetched) and the whole gradients of the running
                one until they are reduce-scattered: `gathered_bytes_per_param` (the runtime
                gathers per unit with FSDP2: runtime/shard_params.py)

Data-parallel traffic per iteration, bytes each holder sends per trainable parameter on a ring
(frozen parameters have nothing to exchange: the profile's trainable bytes are what is sent;
under `parameters` they are gathered, m (n - 1)/n w for the forwards and as much again for the
backwards of units whose backward runs: `frozen_gather_bytes_per_param`)
(`sync_bytes_per_param`; (n - 1)/n of a tensor per reduce-scatter or all-gather, twice that for
an all-reduce; g: gradient bytes, w: parameter bytes, m micro-batches per replica):

    none        2 (n - 1)/n g            all-reduce of the accumulated gradients
    optimizer   (n - 1)/n (g + w)        reduce-scatter the gradients, each steps its shard,
                                         all-gather the parameters
    gradients   (n - 1)/n (m g + w)      a reduce-scatter after every micro-batch's backward (what
                                         keeps only a shard of the gradients), all-gather once
    parameters  (n - 1)/n m (g + 2 w)    every micro-batch gathers each unit's parameters for its
                                         forward and again for its backward (recomputation inside
                                         it), and reduce-scatters its gradients

The cost model charges it once per iteration, not overlapped with compute, over the data-parallel
bandwidth, as it charges the plain all-reduce.

The reserve: memory every process on a device holds besides tensors (CUDA context, NCCL
buffers, cuBLAS workspaces, the caching allocator's slack). Plans keep it free on every device;
`default_reserve` gives a device kind's default, `planner solve --reserve` overrides it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

from planner.pipeline.zerobubble import ZERO_BUBBLE_SCHEDULES
from planner.sizes import DTYPE_BYTES

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
SHARDS = ("none", "optimizer", "gradients", "parameters")
OPTIMIZER_MOMENTS = {"sgd": 0, "adam": 2, "adamw": 2}  # state tensors per parameter (SGD: no momentum)

RUN_PRECISIONS = ("fp32", "bf16-mixed")  # what `runtime execute` runs; pure bf16 is planned, not run


def precision_refusal(precision: str) -> Optional[str]:
    """Why a plan for `precision` does not run (one line: cause and fix), or None."""
    if precision in RUN_PRECISIONS:
        return None
    return (f"the plan is for precision {precision}, which this runtime does not run (it runs "
            f"{' and '.join(RUN_PRECISIONS)}); re-plan with `planner solve --precision bf16-mixed`")


def shard_parameters_refusal(precision: str, schedule: str, replicated: bool) -> Optional[str]:
    """Why parameters sharded across data-parallel holders (ZeRO-3) do not run with this precision,
    schedule and stage replicas (one line: cause and fix), or None."""
    fix = "; re-plan with `planner solve --shard gradients`"
    if replicated:  # a stage's lanes run different micro-batches: their gathers would not pair up
        return ("a plan sharding parameters across replicated stages (--replicate) is not supported; re-plan "
                "without --replicate or with `planner solve --shard optimizer`")
    if precision != "fp32":
        return f"precision {precision} with a plan sharding parameters is not supported (plan it in fp32{fix})"
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return f"the zero-bubble schedule {schedule} with a plan sharding parameters is not supported{fix}"
    return None


def parameter_view_refusal(units) -> Optional[str]:
    """Why parameters sharded across data-parallel holders (ZeRO-3) do not run for a profile whose `units`
    (UnitProfile) include one passing on a view of its own parameter (planner.model.parameter_views), or None."""
    named = [u.name for u in units if getattr(u, "parameter_view", False)]
    if not named:
        return None
    return (f"unit {named[0]!r} passes on a view of its own parameter to the units after it, which sharding "
            "parameters frees when the unit's forward ends; re-plan with `planner solve --shard gradients`, or copy "
            "it in the model's forward (`.contiguous()` after `expand`, or `.clone()`)")


# (params, compute copy, grads, master, one optimizer moment): bytes per parameter, unsharded
_PRECISION_BYTES = {
    "fp32": (4, 0, 4, 0, 4),
    "bf16-mixed": (4, 2, 4, 0, 4),
    "bf16": (2, 0, 2, 0, 2),
}
# the dtype activations and messages are computed in
COMPUTE_DTYPE = {"fp32": "float32", "bf16-mixed": "bfloat16", "bf16": "bfloat16"}

GIB = 2 ** 30
# Default reserve per device kind (bytes). GPUs: what a process holds outside PyTorch's allocator,
# measured on an H200 (BENCHMARKS.md, "LLM scale"): CUDA context 0.61 GiB, with cuBLAS's workspace
# 0.67 GiB, with NCCL (one rank, four communicators) 2.35 GiB; NCCL's buffers for peers (a pipeline
# rank has two neighbours and a data-parallel ring) come on top and could not be measured on one
# GPU: 2.5 GiB. A CPU process's runtime overhead is not capped memory: 0.
DEFAULT_RESERVE = {"cpu": 0, "cuda": int(2.5 * GIB)}


@dataclass(frozen=True)
class ParamBytes:
    """Bytes a holder keeps per parameter of its stage (`bytes_per_param`)."""

    params: float
    compute_copy: float
    grads: float
    master: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.compute_copy + self.grads + self.master + self.optimizer

    @property
    def weights(self) -> float:
        """What every parameter costs its holder for the whole step, frozen or not: its weight and
        the step's compute copy (bf16-mixed)."""
        return self.params + self.compute_copy

    @property
    def training(self) -> float:
        """What a trainable parameter costs on top of `weights`: gradient, master weight, optimizer state."""
        return self.grads + self.master + self.optimizer

    def to_json(self) -> Dict[str, float]:
        return dict(asdict(self), total=self.total)


def check_words(precision: str, shard: str, optimizer: str) -> None:
    """ValueError naming the choices unless the three words are known."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if shard not in SHARDS:
        raise ValueError(f"unknown shard {shard!r}; use one of {', '.join(SHARDS)}")
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(sorted(OPTIMIZER_MOMENTS))}")


def bytes_per_param(precision: str, optimizer: str, shard: str = "none", holders: int = 1) -> ParamBytes:
    """Bytes per parameter each of `holders` devices keeps (module docstring's table and sharding)."""
    check_words(precision, shard, optimizer)
    params, copy, grads, master, moment = _PRECISION_BYTES[precision]
    state = OPTIMIZER_MOMENTS[optimizer] * moment
    n = max(1, holders)
    level = SHARDS.index(shard) if n > 1 else 0  # one holder: nothing to shard
    if level >= 1:
        master, state = master / n, state / n
    if level >= 2:
        grads = grads / n
    if level >= 3:
        params, copy = params / n, 0.0  # the copy is made per gathered unit (gathered_bytes)
    return ParamBytes(float(params), float(copy), float(grads), float(master), float(state))


def sync_bytes_per_param(precision: str, shard: str, holders: int, micro_batches: int) -> float:
    """Bytes each holder sends per parameter per iteration for the data-parallel exchange."""
    check_words(precision, shard, "sgd")
    n, m = holders, micro_batches
    if n <= 1:
        return 0.0
    w, _, g, _, _ = _PRECISION_BYTES[precision]
    share = (n - 1) / n
    if shard == "none":
        return 2 * share * g
    if shard == "optimizer":
        return share * (g + w)
    if shard == "gradients":
        return share * (m * g + w)
    return share * m * (g + 2 * w)


def frozen_gather_bytes_per_param(precision: str, shard: str, holders: int, micro_batches: int) -> float:
    """Bytes each holder sends per frozen parameter per iteration and pass: none (no gradient to
    exchange, the weights never change) except under `parameters` sharding, whose every micro-batch
    gathers them for its forward, m (n - 1)/n w, and again for its backward where the unit's
    backward runs (planner.cost.ranges: `frozen_backward`; runtime/shard_params.py)."""
    check_words(precision, shard, "sgd")
    n, m = holders, micro_batches
    if n <= 1 or shard != "parameters":
        return 0.0
    return (n - 1) / n * m * _PRECISION_BYTES[precision][0]


def gathered_bytes_per_param(precision: str, shard: str) -> Tuple[float, float]:
    """Bytes per parameter of a gathered unit under `parameters` sharding: its weights and compute
    copy, and its whole gradient (per trainable parameter, before the reduce-scatter); 0s otherwise."""
    if shard != "parameters":
        return 0.0, 0.0
    params, copy, grads, _, _ = _PRECISION_BYTES[precision]
    return float(params + copy), float(grads)


def param_itemsize(dtype: str) -> int:
    """Bytes per parameter in a profile of this dtype (its param_bytes / parameters)."""
    return DTYPE_BYTES.get(dtype, 4)


def default_precision(dtype: str) -> str:
    """The precision a profile of this dtype is planned at unless asked otherwise: bf16-mixed for
    half-precision profiles (analytic --dtype bfloat16), fp32 otherwise."""
    return "bf16-mixed" if DTYPE_BYTES.get(dtype, 4) == 2 else "fp32"


def default_reserve(device: str, device_spec: Optional[Dict] = None) -> float:
    """The reserve for a profile's device: its analytic device spec's `reserve_bytes` when it has
    one, else the kind's default (cuda for a GPU, an analytic spec without the field included)."""
    if device_spec is not None:
        if device_spec.get("reserve_bytes") is not None:
            return float(device_spec["reserve_bytes"])
        return float(DEFAULT_RESERVE["cpu" if str(device_spec.get("name", "")).startswith("cpu") else "cuda"])
    return float(DEFAULT_RESERVE["cuda" if str(device).startswith("cuda") else "cpu"])
