"""UnitProfile: one partition unit's record in a profile (times, saved and held bytes per
micro-batch size, parameter bytes), written to and read from its JSON entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from planner.profile.reader import Reader, show, str_keys

# a unit's storages by the value each holds, per micro-batch size ({size: {value name: bytes}})
NAMED_STORAGE_FIELDS = ("shared_saved_bytes", "weight_shared_bytes", "recomputed_shared_bytes", "dropped_saved_bytes")
# a unit's storages its arguments view apart ({size: {storage name: {value name: bytes}}}: UnitProfile.received_parts)
RECEIVED_FIELDS = ("received_parts", "received_saved_parts")
_SPLIT_BACKWARD = ("backward_input_s", "backward_weight_s", "weight_held_bytes")


def _names(value: Any, read: "Reader", where: str) -> List[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise read.error(where, f"is {show(value)}: expected a list of node names")
    return list(value)


def _parts_reader(read: "Reader"):
    """Reads one size's {storage name: {value name: bytes}} (UnitProfile.received_parts)."""
    def parts(value: Any, where: str) -> Dict[str, Dict[str, int]]:
        out = {str(x): read.named_counts(v, f'{where}["{x}"]') for x, v in read.table(value, where).items()}
        for x, views in out.items():
            if not views:
                raise read.error(f'{where}["{x}"]', "is empty: a storage received apart has one argument viewing it "
                                 "at least")
        return out
    return parts


def _check_received(unit: "UnitProfile", read: "Reader", where: str) -> None:
    """received_saved_parts within received_parts (the same bytes), each storage one the unit saves."""
    for b, saved in unit.received_saved_parts.items():
        parts, shared = unit.received_parts.get(b, {}), unit.shared_saved_bytes.get(b, {})
        for x, views in saved.items():
            at = f'{where}.received_saved_parts["{b}"]["{x}"]'
            if x not in shared:
                raise read.error(at, "names a storage the unit's shared_saved_bytes does not (it saves a part of it)")
            if any(parts.get(x, {}).get(v) != n for v, n in views.items()):
                raise read.error(at, "names an argument, or bytes of one, that received_parts does not")


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
    # the unit writes state in its training forward (BatchNorm's running statistics, an EMA or counter in a
    # buffer: planner.model.running_stats): a stage holding it is never replicated. False in older files
    running_stats: bool = False
    # a value a later unit reads is one of the unit's parameters or a view of it (planner.model.parameter_views):
    # the unit does not run with its parameters sharded (ZeRO-3). False in older files
    parameter_view: bool = False

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
    # the storages two or more of its arguments view, or one views part of (a coupling layer's x[:, :k] and
    # x[:, k:]), which a stage receives each in a storage of its own, per micro-batch size: {X: {v: bytes}}, X
    # the storage's name as shared_saved_bytes gives it, v each argument (a value crossing its cut) viewing it and
    # the bytes of v alone (planner.cost.received); received_saved_parts: of them, those whose own storage it
    # saves when its arguments arrive so. Recorded (maybe empty) wherever first_saved_bytes is; absent (older
    # files): not measured, and a stage starting at the unit shares none of its storages with later units
    received_parts: Dict[int, Dict[str, Dict[str, int]]] = field(default_factory=dict)
    received_saved_parts: Dict[int, Dict[str, Dict[str, int]]] = field(default_factory=dict)
    # what its weight part holds more (or less) where its stage computes values it reads: per micro-batch
    # size, {source T (a string): bytes}, the unit holding sum_{T >= a} of them in a stage starting at a
    # (planner.cost.inner_weight). A value whose gradient flows back only into units from its source on
    # (planner.profile.profile_run.value_sources) carries none from the inputs of a stage starting at or
    # before it, and the nodes where it meets them keep their gradients for the weight part (a position
    # bias shared by every block's scores). Empty: none, or not measured (older files, analytic and
    # imported profiles)
    inner_weight_bytes: Dict[int, Dict[str, int]] = field(default_factory=dict)
    # of each, the gradients it keeps (the rest: saved tensors it still holds, which only a unit holding its h
    # counts apart from all it saved). Empty: not measured (all of it counted as held)
    inner_kept_bytes: Dict[int, Dict[str, int]] = field(default_factory=dict)
    # of weight_kept_bytes, per micro-batch size, the gradients of its outputs made from its parameters alone
    # (their source is this unit) by value name: profiled alone it keeps them, inside a stage holding every
    # reader of one nothing does. Empty: none, or not measured
    inner_seed_bytes: Dict[int, Dict[str, int]] = field(default_factory=dict)
    # of inner_seed_bytes, the outputs made from values it reads too, all of source T (a unit before it): not in
    # weight_kept_bytes but in inner_kept_bytes[T] (measured with those values' gradients left to the weight
    # part, it keeps such an output's gradient; a stage starting at or before T and holding the output's last
    # reader does not: a text tower's layers, computed from token ids), {value name: T}; a name not here: T is
    # this unit. Empty: none, or not measured
    inner_seed_sources: Dict[str, int] = field(default_factory=dict)
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
            "forward_s": str_keys(self.forward_s),
            "backward_s": str_keys(self.backward_s),
            "saved_bytes": str_keys(self.saved_bytes),
            "output_bytes": str_keys(self.output_bytes),
            "nodes": list(self.nodes),
            **({"running_stats": True} if self.running_stats else {}),
            **({"parameter_view": True} if self.parameter_view else {}),
            **({"optimizer_s": dict(self.optimizer_s)} if self.optimizer_s else {}),
            **({"buffer_bytes": self.buffer_bytes} if self.buffer_bytes is not None else {}),
            **{name: {str(b): dict(v) for b, v in sorted(getattr(self, name).items())}
               for name in NAMED_STORAGE_FIELDS if getattr(self, name)},
            **({"weight_kept_bytes": str_keys(self.weight_kept_bytes)} if self.weight_kept_bytes else {}),
            **{name: {str(b): dict(v) for b, v in sorted(getattr(self, name).items()) if v}
               for name in ("inner_weight_bytes", "inner_kept_bytes", "inner_seed_bytes")
               if any(getattr(self, name).values())},
            **({"inner_seed_sources": dict(self.inner_seed_sources)} if self.inner_seed_sources else {}),
            **{name: {str(b): {x: dict(views) for x, views in parts.items()}
                      for b, parts in sorted(getattr(self, name).items())}
               for name in RECEIVED_FIELDS if getattr(self, name)},
            **({"input_bytes": str_keys(self.input_bytes)} if self.input_bytes else {}),
            **({"loss_saved_bytes": str_keys(self.loss_saved_bytes)} if self.loss_saved_bytes else {}),
            **({"first_saved_bytes": str_keys(self.first_saved_bytes)} if self.first_saved_bytes else {}),
            **({"first_weight_held_bytes": str_keys(self.first_weight_held_bytes)}
               if self.first_weight_held_bytes else {}),
            **({"weight_calls": self.weight_calls, "weight_walk_nodes": self.weight_walk_nodes}
               if self.weight_calls or self.weight_walk_nodes else {}),
            **({"backward_input_s": str_keys(self.backward_input_s),
                "backward_weight_s": str_keys(self.backward_weight_s),
                "weight_held_bytes": str_keys(self.weight_held_bytes)} if self.split_backward else {}),
        }

    @classmethod
    def from_json(cls, d: Dict[str, Any], read: "Reader", where: str) -> "UnitProfile":
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
        flags = {key: d.get(key, False) for key in ("running_stats", "parameter_view")}
        for key, flag in flags.items():
            if not isinstance(flag, bool):
                raise read.error(f"{where}.{key}", f"is {show(flag)}: expected true or false")
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
            **flags,
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
            **{name: read.per_size(d.get(name) or {}, f"{where}.{name}", read.signed_counts, required=False)
               for name in ("inner_weight_bytes", "inner_kept_bytes")},
            inner_seed_bytes=read.per_size(d.get("inner_seed_bytes") or {}, f"{where}.inner_seed_bytes",
                                           read.named_counts, required=False),
            inner_seed_sources=read.named_counts(d.get("inner_seed_sources") or {}, f"{where}.inner_seed_sources"),
            weight_calls=read.count(d.get("weight_calls", 0), f"{where}.weight_calls", "call counts"),
            weight_walk_nodes=read.count(d.get("weight_walk_nodes", 0), f"{where}.weight_walk_nodes",
                                         "node counts"),
            **{name: read.per_size(d.get(name) or {}, f"{where}.{name}", read.named_counts, required=False)
               for name in NAMED_STORAGE_FIELDS},
            **{name: read.per_size(d.get(name) or {}, f"{where}.{name}", _parts_reader(read), required=False)
               for name in RECEIVED_FIELDS},
            **split_values,
        )
        _check_received(unit, read, where)
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
        # the storages both name: shared ones by value name, dropped ones by the same names ("" the rest)
        for b, dropped in unit.dropped_saved_bytes.items():
            shared = unit.shared_saved_bytes.get(b, {})
            named = sum(max(shared.get(name, 0), dropped.get(name, 0)) for name in set(shared) | set(dropped))
            if b in unit.saved_bytes and named > unit.saved_bytes[b]:
                raise read.error(f'{where}.dropped_saved_bytes["{b}"]',
                                 f"with the shared_saved_bytes names {named} bytes: more than the unit's "
                                 f"saved_bytes ({unit.saved_bytes[b]}), of which they are a part")
        for b, inner in unit.inner_weight_bytes.items():  # what it holds at each start: never below 0
            held = unit.weight_held_bytes.get(b, 0)
            for key in sorted(inner, key=lambda key: -int(key) if key.isdigit() else 0):
                held += inner[key]
                if held < 0:
                    raise read.error(f'{where}.inner_weight_bytes["{b}"]', "takes more than the unit's "
                                     "weight_held_bytes holds")
        for b, seeds in unit.inner_seed_bytes.items():  # those of its own source (inner_seed_sources names the rest)
            own = sum(n for name, n in seeds.items() if name not in unit.inner_seed_sources)
            if own > unit.weight_kept_bytes.get(b, 0):
                raise read.error(f'{where}.inner_seed_bytes["{b}"]', f"sums to {own} bytes: more than "
                                 "the unit's weight_kept_bytes, of which they are a part")
        for b, kept in unit.weight_kept_bytes.items():
            if kept > unit.weight_held_bytes.get(b, kept):
                raise read.error(f'{where}.weight_kept_bytes["{b}"]', f"is {kept}: more than the unit's "
                                 f"weight_held_bytes ({unit.weight_held_bytes[b]}), of which it is a part")
        return unit
