"""The profile file: what `planner profile` measured, as typed data.

A profile describes a model cut into L ordered partition units. Cut k (1 <= k < L) is the
boundary just before unit k; the values crossing it are those produced before unit k and
consumed at or after it (skip connections included). Model inputs are never counted as
crossing: every rank rebuilds the batch itself from the deterministic `batch` function.

Per-micro-batch-size numbers are dicts keyed by the micro-batch size (int in memory, str in
JSON). Times are seconds, sizes are bytes. Reading a file checks it (`_Reader`'s rules): every
command that takes a profile refuses a bad one in one line naming the first bad field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from planner.jsonio import JsonFileError, newer_schema, read_json, write_json_atomic
from planner.sizes import MAX_BYTES

PROFILE_SCHEMA_VERSION = 2  # the newest this code reads and writes
# a profile measured under a precision (Profile.precision) is written as version 2: a planner that
# reads version 1 only would take its bytes for the model's dtype's and scale them again; every
# other profile stays version 1, which older planners read
PLAIN_SCHEMA_VERSION = 1
MEASURED_PRECISIONS = ("bf16-mixed",)  # Profile.precision's values (None: as built)
PROFILE_PRECISIONS = ("fp32",) + MEASURED_PRECISIONS  # what a profile is measured under: as built, or one of those

# Optimizer state bytes held per parameter byte (SGD without momentum: none; Adam: two moments).
OPTIMIZER_STATE_PER_PARAM_BYTE = {"sgd": 0.0, "adamw": 2.0, "adam": 2.0}
# a unit's storages by the value each holds, per micro-batch size ({size: {value name: bytes}})
NAMED_STORAGE_FIELDS = ("shared_saved_bytes", "weight_shared_bytes", "recomputed_shared_bytes", "dropped_saved_bytes")


def _str_keys(d: Dict[int, Any]) -> Dict[str, Any]:
    return {str(k): v for k, v in sorted(d.items())}


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


# the dtypes a value crossing a cut may have: those runtime.comm sends
MESSAGE_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                  "complex64", "complex128", "complex32")
MAX_SECONDS = 1e6  # a time past this (11 days a unit) is a broken file; the solvers' arithmetic needs bounds


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _names(value: Any, read: "_Reader", where: str) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise read.error(where, f"is {_show(value)}: expected a list of node names")
    return list(value)


class _Reader:
    """Reads a profile's JSON values, naming the first bad one by its path in the file.

    Rules: times are finite numbers of seconds >= 0, byte counts finite numbers >= 0, every unit
    and every cut value has an entry at every listed micro-batch size, cut k sits before unit k.
    """

    def __init__(self, source: str, sizes: List[int]):
        self.source = source  # "profile 'path'" or "profile"
        self.sizes = sizes

    def error(self, where: str, problem: str) -> JsonFileError:
        return JsonFileError(f"{self.source}: {where} {problem}; re-run `planner profile`")

    def number(self, value: Any, where: str, rule: str, most: float = math.inf) -> float:
        number = _as_float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        if not (math.isfinite(number) and 0 <= number <= most):  # NaN, inf and an int no float holds fail too
            raise self.error(where, f"is {_show(value)}: {rule}")
        return number

    def seconds(self, value: Any, where: str) -> float:
        return self.number(value, where, f"times must be finite, >= 0 and at most {MAX_SECONDS:.0e}", MAX_SECONDS)

    def count(self, value: Any, where: str) -> int:
        return int(self.number(value, where, f"byte counts must be >= 0 and at most {MAX_BYTES:.0e}", MAX_BYTES))

    def named_counts(self, d: Any, where: str) -> Dict[str, int]:
        """{value name: bytes}, each a count."""
        return {str(k): self.count(n, f'{where}["{k}"]') for k, n in self.table(d, where).items()}

    def table(self, d: Any, where: str) -> Dict[str, Any]:
        if not isinstance(d, dict):
            raise self.error(where, f"is {_show(d)}: expected an object")
        return d

    def per_size(self, d: Any, where: str, read: Callable[[Any, str], Any], required: bool = True) -> Dict[int, Any]:
        """{micro-batch size: read(value)}; every listed size must be there when `required` (others
        may hold some sizes: stage_overhead_s lacks those the whole model was not timed at)."""
        out: Dict[int, Any] = {}
        for key, value in self.table(d, where).items():
            try:
                b = int(key)
            except ValueError:
                raise self.error(where, f"has key {_show(key)}: keys are micro-batch sizes") from None
            out[b] = read(value, f'{where}["{key}"]')
        missing = [b for b in self.sizes if b not in out]
        if missing and required:
            raise self.error(where, f"has no entry for micro-batch size {missing[0]} (micro_batch_sizes lists it)")
        return out


_SPLIT_BACKWARD = ("backward_input_s", "backward_weight_s", "weight_held_bytes")
# Profile.split_overhead_s's parts, as its JSON names them
_SPLIT_OVERHEAD = ("first_input", "input", "weight")


@dataclass
class UnitProfile:
    """One partition unit: a contiguous run of graph nodes (e.g. one transformer block)."""

    name: str
    param_bytes: int
    forward_s: Dict[int, float]
    backward_s: Dict[int, float]
    saved_bytes: Dict[int, int]  # bytes saved for backward (parameters excluded), per micro-batch
    output_bytes: Dict[int, int]
    nodes: List[str] = field(default_factory=list)
    # seconds of one optimizer step over this unit's parameters, per optimizer ("sgd", "adamw");
    # empty where it was not measured (analytic and imported profiles, older files)
    optimizer_s: Dict[str, float] = field(default_factory=dict)
    # bytes of the parameters that train (requires_grad): only they have gradients, master weights
    # and optimizer state; the rest of param_bytes is frozen. None (older files, imported
    # profiles): every parameter trains
    trainable_bytes: Optional[int] = None
    # the unit updates buffers in its training forward (BatchNorm's running statistics,
    # planner.model.running_stats): a stage holding it is never replicated. False in older files
    running_stats: bool = False

    # bytes of the unit's floating-point buffers (BatchNorm's running statistics): what local SGD's
    # averaging exchanges besides the trainable parameters (runtime.localsgd), in their own dtype.
    # None (older files, analytic and imported profiles): not counted
    buffer_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.trainable_bytes is None:
            self.trainable_bytes = self.param_bytes

    @property
    def frozen_bytes(self) -> int:
        """Bytes of parameters that do not train (requires_grad=False): weights only."""
        return self.param_bytes - self.trainable_bytes

    # the backward in two parts (zero-bubble schedules): the input gradients' seconds, the weight
    # gradients' seconds, and the bytes held from the first to the second, per micro-batch; all
    # three or none (older profiles: planner.cost.ranges estimates them)
    backward_input_s: Dict[int, float] = field(default_factory=dict)
    backward_weight_s: Dict[int, float] = field(default_factory=dict)
    weight_held_bytes: Dict[int, int] = field(default_factory=dict)
    # bytes of the model's inputs (tensors) the unit reads, per micro-batch size: what it keeps
    # besides its cut's activations when recomputed (planner.cost.ranges' in_l). Empty: not
    # measured (older files, analytic and imported profiles): 0
    input_bytes: Dict[int, int] = field(default_factory=dict)
    # the last unit only: bytes the loss function saves for backward (its input, the target), per
    # micro-batch size. The loss runs after the stage, outside a recomputed unit's recomputation, so a
    # recomputed last unit holds them besides its inputs (planner.cost.ranges' in_l). Empty: not
    # measured (older files, imported profiles): 0
    loss_saved_bytes: Dict[int, int] = field(default_factory=dict)
    # saved_bytes and weight_held_bytes when the unit starts a stage, per micro-batch size, where they
    # differ: a rank receives each input in a storage of its own, while inside a stage two of them may
    # share one (a tensor and a view of it) or be views of a larger one. Empty: the same
    first_saved_bytes: Dict[int, int] = field(default_factory=dict)
    first_weight_held_bytes: Dict[int, int] = field(default_factory=dict)
    # of weight_held_bytes, the gradients kept for the weight part (the rest is saved tensors still
    # referenced), per micro-batch size. Empty: not measured (older files)
    weight_kept_bytes: Dict[int, int] = field(default_factory=dict)
    # of saved_bytes, per micro-batch size, the storages other units may save too, by the value they
    # hold (a value it received or produced for later units, a model input, a value every stage
    # computes again): a stage holding two neighbours that save one counts it once
    # (planner.cost.ranges). Empty: not measured (older files, analytic and imported profiles)
    shared_saved_bytes: Dict[int, Dict[str, int]] = field(default_factory=dict)
    # of shared_saved_bytes, those it still holds after its input part (zero-bubble schedules: what
    # a later stage's last unit and the unit before it hold once until the weight part). Empty: not
    # measured (older files): all of them
    weight_shared_bytes: Dict[int, Dict[str, int]] = field(default_factory=dict)
    # what the unit keeps when recomputed (its inputs: the values crossing its cut and the model's inputs
    # it reads, runtime.stage's checkpoint), per micro-batch size, by the value each storage holds, as
    # shared_saved_bytes names them: the unit before may save one of them (a skip it reads, a model input),
    # one storage (planner.cost.ranges' r_k). Empty: not measured (older files, analytic and imported
    # profiles): no storage counted once
    recomputed_shared_bytes: Dict[int, Dict[str, int]] = field(default_factory=dict)
    # of saved_bytes, per micro-batch size, the storages autograd frees as soon as the forward returns
    # (its outputs held): saved by a node no output reaches, as a gate whose argmax cuts the graph (a
    # routed layer) or a recomputed unit attached to no graph. The ranks count them as saved, and not
    # as held between a zero-bubble stage's backward parts (planner.cost.ranges' x_l), by the value each
    # storage holds as shared_saved_bytes names them ("" for storages no value of the unit names).
    # Empty: not measured (older files, analytic and imported profiles): none
    dropped_saved_bytes: Dict[int, Dict[str, int]] = field(default_factory=dict)
    # its weight part's autograd calls (parameter groups) and the autograd nodes of its backward graph:
    # each later call of its stage walks these nodes (Profile.weight_walk_s; planner.cost.ranges). 0: not
    # measured (older files)
    weight_calls: int = 0
    weight_walk_nodes: int = 0

    @property
    def split_backward(self) -> bool:
        return bool(self.backward_weight_s)

    def to_json(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "param_bytes": self.param_bytes,
            "trainable_bytes": self.trainable_bytes,
            "forward_s": _str_keys(self.forward_s),
            "backward_s": _str_keys(self.backward_s),
            "saved_bytes": _str_keys(self.saved_bytes),
            "output_bytes": _str_keys(self.output_bytes),
            "nodes": list(self.nodes),
            **({"running_stats": True} if self.running_stats else {}),
            **({"optimizer_s": dict(self.optimizer_s)} if self.optimizer_s else {}),
            **({"buffer_bytes": self.buffer_bytes} if self.buffer_bytes is not None else {}),
            **{name: {str(b): dict(v) for b, v in sorted(getattr(self, name).items())}
               for name in NAMED_STORAGE_FIELDS if getattr(self, name)},
            **({"weight_kept_bytes": _str_keys(self.weight_kept_bytes)} if self.weight_kept_bytes else {}),
            **({"input_bytes": _str_keys(self.input_bytes)} if self.input_bytes else {}),
            **({"loss_saved_bytes": _str_keys(self.loss_saved_bytes)} if self.loss_saved_bytes else {}),
            **({"first_saved_bytes": _str_keys(self.first_saved_bytes)} if self.first_saved_bytes else {}),
            **({"first_weight_held_bytes": _str_keys(self.first_weight_held_bytes)}
               if self.first_weight_held_bytes else {}),
            **({"weight_calls": self.weight_calls, "weight_walk_nodes": self.weight_walk_nodes}
               if self.weight_calls or self.weight_walk_nodes else {}),
            **({"backward_input_s": _str_keys(self.backward_input_s),
                "backward_weight_s": _str_keys(self.backward_weight_s),
                "weight_held_bytes": _str_keys(self.weight_held_bytes)} if self.split_backward else {}),
        }

    @classmethod
    def from_json(cls, d: Dict[str, Any], read: "_Reader", where: str) -> "UnitProfile":
        d = read.table(d, where)
        if not isinstance(d.get("name"), str) or not d["name"]:
            raise read.error(f"{where}.name", "is missing: every unit has a name")
        param_bytes = read.count(d.get("param_bytes"), f"{where}.param_bytes")
        trainable = read.count(d.get("trainable_bytes", param_bytes), f"{where}.trainable_bytes")
        if trainable > param_bytes:
            raise read.error(f"{where}.trainable_bytes", f"is {trainable}: more than the unit's param_bytes "
                             f"({param_bytes})")
        split = [k for k in _SPLIT_BACKWARD if k in d]
        if split and len(split) != len(_SPLIT_BACKWARD):
            missing = next(k for k in _SPLIT_BACKWARD if k not in d)
            raise read.error(f"{where}.{missing}", f"is missing: a unit with {split[0]} needs all of "
                             f"{', '.join(_SPLIT_BACKWARD)}")
        running_stats = d.get("running_stats", False)
        if not isinstance(running_stats, bool):
            raise read.error(f"{where}.running_stats", f"is {_show(running_stats)}: expected true or false")
        parts = {"backward_input_s": read.seconds, "backward_weight_s": read.seconds, "weight_held_bytes": read.count}
        split_values = {k: read.per_size(d[k], f"{where}.{k}", parts[k]) for k in split}
        unit = cls(
            name=d["name"],
            param_bytes=param_bytes,
            trainable_bytes=trainable,
            forward_s=read.per_size(d.get("forward_s"), f"{where}.forward_s", read.seconds),
            backward_s=read.per_size(d.get("backward_s"), f"{where}.backward_s", read.seconds),
            saved_bytes=read.per_size(d.get("saved_bytes"), f"{where}.saved_bytes", read.count),
            output_bytes=read.per_size(d.get("output_bytes", {}), f"{where}.output_bytes", read.count, required=False),
            nodes=_names(d.get("nodes", []), read, f"{where}.nodes"),
            running_stats=running_stats,
            optimizer_s={str(k): read.seconds(v, f'{where}.optimizer_s["{k}"]')
                         for k, v in read.table(d.get("optimizer_s") or {}, f"{where}.optimizer_s").items()},
            buffer_bytes=read.count(d["buffer_bytes"], f"{where}.buffer_bytes") if "buffer_bytes" in d else None,
            input_bytes=read.per_size(d.get("input_bytes") or {}, f"{where}.input_bytes", read.count, required=False),
            loss_saved_bytes=read.per_size(d.get("loss_saved_bytes") or {}, f"{where}.loss_saved_bytes", read.count,
                                           required=False),
            first_saved_bytes=read.per_size(d.get("first_saved_bytes") or {}, f"{where}.first_saved_bytes",
                                            read.count, required=False),
            first_weight_held_bytes=read.per_size(d.get("first_weight_held_bytes") or {},
                                                  f"{where}.first_weight_held_bytes", read.count, required=False),
            weight_kept_bytes=read.per_size(d.get("weight_kept_bytes") or {}, f"{where}.weight_kept_bytes", read.count,
                                            required=False),
            weight_calls=read.count(d.get("weight_calls", 0), f"{where}.weight_calls"),
            weight_walk_nodes=read.count(d.get("weight_walk_nodes", 0), f"{where}.weight_walk_nodes"),
            **{name: read.per_size(d.get(name) or {}, f"{where}.{name}", read.named_counts, required=False)
               for name in NAMED_STORAGE_FIELDS},
            **split_values,
        )
        for b, held in unit.weight_shared_bytes.items():
            if any(held[name] > unit.shared_saved_bytes.get(b, {}).get(name, -1) for name in held):
                raise read.error(f'{where}.weight_shared_bytes["{b}"]', "names a value, or more bytes of one, than "
                                 "the unit's shared_saved_bytes, of which it is a part")
        # parts of what the unit saves and holds: never more than the whole (the cost model subtracts them)
        for name in ("shared_saved_bytes", "dropped_saved_bytes"):
            for b, part in getattr(unit, name).items():
                if b in unit.saved_bytes and sum(part.values()) > unit.saved_bytes[b]:
                    raise read.error(f'{where}.{name}["{b}"]',
                                     f"sums to {sum(part.values())} bytes: more than the unit's saved_bytes "
                                     f"({unit.saved_bytes[b]}), of which they are a part")
        for b, kept in unit.weight_kept_bytes.items():
            if kept > unit.weight_held_bytes.get(b, kept):
                raise read.error(f'{where}.weight_kept_bytes["{b}"]', f"is {kept}: more than the unit's "
                                 f"weight_held_bytes ({unit.weight_held_bytes[b]}), of which it is a part")
        return unit


@dataclass
class CutValue:
    """A value crossing a cut: a tensor (sent point-to-point) or a constant (e.g. a size).

    Constants depend only on the micro-batch size, so the runtime injects them instead of
    sending them.
    """

    name: str
    kind: str  # "tensor" | "constant"
    dtype: Optional[str] = None
    requires_grad: bool = False
    shape: Dict[int, List[int]] = field(default_factory=dict)
    bytes: Dict[int, int] = field(default_factory=dict)
    value: Dict[int, Any] = field(default_factory=dict)

    def to_json(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "tensor":
            d.update(dtype=self.dtype, requires_grad=self.requires_grad,
                     shape=_str_keys(self.shape), bytes=_str_keys(self.bytes))
        else:
            d["value"] = _str_keys(self.value)
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any], read: "_Reader", where: str) -> "CutValue":
        d = read.table(d, where)
        kind = d.get("kind")
        if kind not in ("tensor", "constant"):
            raise read.error(f"{where}.kind", f"is {_show(kind)}: expected \"tensor\" or \"constant\"")

        def shape(value: Any, at: str) -> List[int]:
            if not isinstance(value, list):
                raise read.error(at, f"is {_show(value)}: expected a list of sizes")
            return [read.count(n, f"{at}[{i}]") for i, n in enumerate(value)]

        tensor = kind == "tensor"
        name, dtype, grad = d.get("name", ""), d.get("dtype"), d.get("requires_grad", False)
        if not (isinstance(name, str) and name):
            raise read.error(f"{where}.name", f"is {_show(name)}: expected the value's name")
        if tensor and dtype not in MESSAGE_DTYPES:
            raise read.error(f"{where}.dtype", f"is {_show(dtype)}: expected one of {', '.join(MESSAGE_DTYPES)}")
        if not isinstance(grad, bool):
            raise read.error(f"{where}.requires_grad", f"is {_show(grad)}: expected true or false")
        return cls(
            name=name,
            kind=kind,
            dtype=dtype,
            requires_grad=grad,
            shape=read.per_size(d.get("shape", {}), f"{where}.shape", shape, required=tensor),
            bytes=read.per_size(d.get("bytes", {}), f"{where}.bytes", read.count, required=tensor),
            value=read.per_size(d.get("value", {}), f"{where}.value", lambda v, _: v, required=not tensor),
        )

    def at(self, micro_batch_size: int) -> Dict[str, Any]:
        """This value's description at one micro-batch size (what a plan's stage carries)."""
        b = micro_batch_size
        if self.kind == "tensor":
            return {"name": self.name, "kind": "tensor", "dtype": self.dtype,
                    "requires_grad": self.requires_grad, "shape": self.shape[b], "bytes": self.bytes[b]}
        return {"name": self.name, "kind": "constant", "value": self.value[b]}


@dataclass
class CutProfile:
    """Cut k: the boundary before unit k."""

    before_unit: int
    values: List[CutValue]

    def activation_bytes(self, b: int) -> int:
        """Bytes sent forward across this cut for one micro-batch of size b."""
        return sum(v.bytes[b] for v in self.values if v.kind == "tensor")

    def gradient_bytes(self, b: int) -> int:
        """Bytes of gradients sent backward across this cut for one micro-batch of size b."""
        return sum(v.bytes[b] for v in self.values if v.kind == "tensor" and v.requires_grad)

    def to_json(self) -> Dict[str, Any]:
        return {"before_unit": self.before_unit, "values": [v.to_json() for v in self.values]}

    @classmethod
    def from_json(cls, d: Dict[str, Any], read: "_Reader", where: str, k: int) -> "CutProfile":
        """Cut k, the k-th entry of the file's cuts (before unit k)."""
        d = read.table(d, where)
        if d.get("before_unit") != k or isinstance(d.get("before_unit"), bool):
            raise read.error(f"{where}.before_unit", f"is {_show(d.get('before_unit'))}: cuts are listed in "
                             f"order, the k-th before unit k (expected {k})")
        values = d.get("values")
        if not isinstance(values, list):
            raise read.error(f"{where}.values", "is missing: expected the list of values crossing the cut")
        return cls(before_unit=k, values=[CutValue.from_json(v, read, f"{where}.values[{i}]")
                                          for i, v in enumerate(values)])


@dataclass
class Profile:
    model: Dict[str, Any]  # {"entry": str, "args": dict, "seed": int}
    micro_batch_sizes: List[int]
    units: List[UnitProfile]
    cuts: List[CutProfile]  # cuts[k - 1] is cut k, for k = 1 .. L-1
    device: str = "cpu"
    device_name: str = ""
    threads: int = 1
    dtype: str = "float32"
    torch_version: str = ""
    capture: str = "fx"
    repeats: int = 5
    extra: Dict[str, Any] = field(default_factory=dict)
    # b -> (forward, backward) seconds a stage pays once per micro-batch whatever units it holds
    # (a call's fixed cost: Python, autograd's engine start); unit times exclude it. Empty: none.
    stage_overhead_s: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    # (forward, backward) seconds the runtime's engine adds per micro-batch to every stage's compute
    # (runtime.engine_probe: its per-action work, measured on a null stage); (0, 0): not measured
    engine_overhead_s: Tuple[float, float] = (0.0, 0.0)
    # b -> seconds of a split backward's own cost per micro-batch (planner.cost.ranges):
    # (the first stage's input part, a later stage's input part and weight part on top of its units'
    # parts). Empty: not measured (older profiles)
    split_overhead_s: Dict[int, Tuple[float, float, float]] = field(default_factory=dict)
    # b -> seconds a later stage's weight-part call spends per autograd node of the stage's earlier units
    # it walks (planner.cost.ranges' walk term; UnitProfile.weight_calls, weight_walk_nodes). Empty: none
    weight_walk_s: Dict[int, float] = field(default_factory=dict)
    # the precision the units ran at while measured: "bf16-mixed" (`planner profile --precision
    # bf16-mixed`: autocast and the runtime's bf16 compute copies; every activation, output and cut
    # byte count and every cut dtype is such a run's, param_bytes stay the model's `dtype`), or None:
    # as built, in `dtype`, no autocast (older, analytic and plain profiles)
    precision: Optional[str] = None

    def stage_overhead(self, b: int) -> Tuple[float, float]:
        """(forward, backward) seconds one stage pays per micro-batch of size b on top of its units:
        the call's fixed cost the profile measured and the engine's own work."""
        call_f, call_b = self.stage_overhead_s.get(b, (0.0, 0.0))
        return call_f + self.engine_overhead_s[0], call_b + self.engine_overhead_s[1]

    @property
    def host_kernel(self) -> Dict[str, Any]:
        """The host-speed reference kernel timed around the measurement ({} where it was not:
        off CPU, analytic or older profiles; planner.profile.hostspeed)."""
        return (self.extra.get("measured_under") or {}).get("host_kernel") or {}

    @property
    def num_units(self) -> int:
        return len(self.units)

    def cut(self, k: int) -> CutProfile:
        """Cut k (1 <= k < L): the boundary just before unit k."""
        if not 1 <= k < len(self.units):
            raise IndexError(f"cut {k} out of range 1..{len(self.units) - 1}")
        return self.cuts[k - 1]

    @property
    def schema_version(self) -> int:
        """What its file says: 2 where measured under a precision, else 1 (older planners read it)."""
        return PROFILE_SCHEMA_VERSION if self.precision else PLAIN_SCHEMA_VERSION

    def to_json(self) -> Dict[str, Any]:
        d = {
            "schema_version": self.schema_version,
            "kind": "profile",
            "torch_version": self.torch_version,
            "device": self.device,
            "device_name": self.device_name,
            "threads": self.threads,
            "dtype": self.dtype,
            "capture": self.capture,
            "repeats": self.repeats,
            "model": self.model,
            "micro_batch_sizes": list(self.micro_batch_sizes),
            "optimizer_state_bytes_per_param_byte": dict(OPTIMIZER_STATE_PER_PARAM_BYTE),
            "units": [u.to_json() for u in self.units],
            "cuts": [c.to_json() for c in self.cuts],
        }
        if self.stage_overhead_s:
            d["stage_overhead_s"] = {str(b): {"forward": f, "backward": g}
                                     for b, (f, g) in sorted(self.stage_overhead_s.items())}
        if any(self.engine_overhead_s):
            d["engine_overhead_s"] = {"forward": self.engine_overhead_s[0], "backward": self.engine_overhead_s[1]}
        if self.split_overhead_s:
            d["split_overhead_s"] = {str(b): dict(zip(_SPLIT_OVERHEAD, parts))
                                     for b, parts in sorted(self.split_overhead_s.items())}
        if self.weight_walk_s:
            d["weight_walk_s"] = _str_keys(self.weight_walk_s)
        if self.precision:
            d["precision"] = self.precision
        d.update(self.extra)
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any], source: str = "profile") -> "Profile":
        """The profile in `d`, checked (see _Reader): a JsonFileError names the first bad field."""
        if not isinstance(d, dict) or d.get("kind", "profile") != "profile" or "units" not in d:
            raise JsonFileError("this is not a profile file (no 'units'); make one with `planner profile MODEL`")
        version = d.get("schema_version")
        if isinstance(version, bool) or version not in (PLAIN_SCHEMA_VERSION, PROFILE_SCHEMA_VERSION):
            raise JsonFileError(
                f"profile schema_version {version!r} is not supported (expected {PLAIN_SCHEMA_VERSION} or "
                f"{PROFILE_SCHEMA_VERSION}); "
                f"{newer_schema(version, PROFILE_SCHEMA_VERSION)}re-run `planner profile` with this version")
        read = _Reader(source, [])
        precision = d.get("precision")
        if precision is not None and precision not in MEASURED_PRECISIONS:
            raise read.error("precision", f"is {_show(precision)}: expected {' or '.join(MEASURED_PRECISIONS)} "
                             "(or no field: measured as built)")
        if precision is not None and version < PROFILE_SCHEMA_VERSION:
            raise read.error("precision", f"needs schema_version {PROFILE_SCHEMA_VERSION} (the file says {version})")
        sizes = d.get("micro_batch_sizes")
        if not isinstance(sizes, list) or not sizes or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes) or len(set(sizes)) < len(sizes):
            raise read.error("micro_batch_sizes", f"is {_show(sizes)}: expected distinct positive integers")
        read.sizes = sizes
        if not isinstance(d["units"], list) or not d["units"]:
            raise read.error("units", f"is {_show(d['units'])}: expected a list of at least one unit")
        units = [UnitProfile.from_json(u, read, f"units[{i}]") for i, u in enumerate(d["units"])]
        first_of: Dict[str, int] = {}
        for i, u in enumerate(units):
            if first_of.setdefault(u.name, i) != i:
                raise read.error(f"units[{i}].name", f"{u.name!r} repeats units[{first_of[u.name]}].name: "
                                 "unit names are unique")
        cuts_json = d.get("cuts", [])
        if not isinstance(cuts_json, list) or len(cuts_json) != len(units) - 1:
            found = len(cuts_json) if isinstance(cuts_json, list) else _show(cuts_json)
            raise read.error("cuts", f"has {found} entries: {len(units)} units have {len(units) - 1} cuts")
        cuts = [CutProfile.from_json(c, read, f"cuts[{k - 1}]", k) for k, c in enumerate(cuts_json, start=1)]
        overhead = {}
        for b, pair in read.per_size(d.get("stage_overhead_s") or {}, "stage_overhead_s", read.table,
                                     required=False).items():
            where = f'stage_overhead_s["{b}"]'
            overhead[b] = (read.seconds(pair.get("forward"), f"{where}.forward"),
                           read.seconds(pair.get("backward"), f"{where}.backward"))
        split = {}
        for b, parts in read.per_size(d.get("split_overhead_s") or {}, "split_overhead_s", read.table,
                                      required=False).items():
            split[b] = tuple(read.seconds(parts.get(name), f'split_overhead_s["{b}"].{name}')
                             for name in _SPLIT_OVERHEAD)
        walk = read.per_size(d.get("weight_walk_s") or {}, "weight_walk_s", read.seconds, required=False)
        engine = read.table(d.get("engine_overhead_s") or {}, "engine_overhead_s")
        engine_overhead = (read.seconds(engine.get("forward", 0.0), "engine_overhead_s.forward"),
                           read.seconds(engine.get("backward", 0.0), "engine_overhead_s.backward"))
        _check_extra(read, d, set(first_of))
        known = {"schema_version", "kind", "torch_version", "device", "device_name", "threads", "dtype",
                 "capture", "repeats", "model", "micro_batch_sizes", "optimizer_state_bytes_per_param_byte",
                 "units", "cuts", "stage_overhead_s", "engine_overhead_s", "split_overhead_s", "weight_walk_s",
                 "precision"}
        return cls(
            model=d.get("model", {}),
            micro_batch_sizes=sizes,
            units=units,
            cuts=cuts,
            device=d.get("device", "cpu"),
            device_name=d.get("device_name", ""),
            threads=read.count(d.get("threads", 1), "threads"),
            dtype=d.get("dtype", "float32"),
            torch_version=d.get("torch_version", ""),
            capture=d.get("capture", "fx"),
            repeats=read.count(d.get("repeats", 5), "repeats"),
            extra={k: v for k, v in d.items() if k not in known},
            stage_overhead_s=overhead,
            engine_overhead_s=engine_overhead,
            split_overhead_s=split,
            weight_walk_s=walk,
            precision=precision,
        )


def _check_extra(read: _Reader, d: Dict[str, Any], unit_names: set) -> None:
    """The optional parts a solve reads: tied parameters, the measured link, a calibration."""
    shared = d.get("shared_parameters") or []
    if not isinstance(shared, list):
        raise read.error("shared_parameters", "is not a list")
    for i, entry in enumerate(shared):
        where = f"shared_parameters[{i}]"
        entry = read.table(entry, where)
        read.count(entry.get("bytes"), f"{where}.bytes")
        units = entry.get("units")
        if not isinstance(units, list) or any(u not in unit_names for u in units):
            raise read.error(f"{where}.units", f"is {_show(units)}: expected names of the profile's units")
    for part in ("link", "calibration"):
        fields = d.get(part) or {}
        read.table(fields, part)
        if fields.get("bandwidth_bytes_per_s") is not None:
            where = f"{part}.bandwidth_bytes_per_s"
            if not read.number(fields["bandwidth_bytes_per_s"], where, "a bandwidth is finite and > 0") > 0:
                raise read.error(where, "is 0: a bandwidth is finite and > 0")
        for key in ("latency_s", "step_overhead_s", "message_s"):
            if fields.get(key) is not None:
                read.seconds(fields[key], f"{part}.{key}")
    model = read.table(d.get("model") or {}, "model")  # the plan copies its entry, args and seed
    entry, args, seed = model.get("entry"), model.get("args", {}), model.get("seed", 0)
    if entry is not None and not (isinstance(entry, str) and entry):
        raise read.error("model.entry", f"is {entry!r}, not a model entry (builtin:NAME, package.module:function)")
    read.table(args if args is not None else {}, "model.args")
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 63):
        raise read.error("model.seed", f"is {seed!r}, not an integer >= 0")
    measured_under = d.get("measured_under") or {}
    read.table(measured_under, "measured_under")
    kernel = read.table(measured_under.get("host_kernel") or {}, "measured_under.host_kernel")
    if kernel.get("mean_s") is not None:  # runs compare their own kernel's time with it
        read.seconds(kernel["mean_s"], "measured_under.host_kernel.mean_s")
    rhythm = (d.get("link") or {}).get("rhythm")
    if rhythm is not None:  # planner.profile.rhythm's record; planner solve reads its latency
        read.table(rhythm, "link.rhythm")
        for key in ("latency_s", "forward_s", "backward_s"):
            read.seconds(rhythm.get(key), f"link.rhythm.{key}")
    reduced = (d.get("link") or {}).get("allreduce")
    if reduced is not None:
        read.table(reduced, "link.allreduce")
        where = "link.allreduce.bandwidth_bytes_per_s"
        if not read.number(reduced.get("bandwidth_bytes_per_s"), where, "a bandwidth is finite and > 0") > 0:
            raise read.error(where, "is 0: a bandwidth is finite and > 0")


def load_profile(path: str) -> Profile:
    return Profile.from_json(read_json(path, what="profile"), source=f"profile {path!r}")


def save_profile(profile: Profile, path: str) -> None:
    write_json_atomic(path, profile.to_json())
