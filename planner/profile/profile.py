"""The profile file: what `planner profile` measured, as typed data.

A profile describes a model cut into L ordered partition units. Cut k (1 <= k < L) is the
boundary just before unit k; the values crossing it are those produced before unit k and
consumed at or after it (skip connections included). Model inputs are never counted as
crossing: every rank rebuilds the batch itself from the deterministic `batch` function.

Per-micro-batch-size numbers are dicts keyed by the micro-batch size (int in memory, str in
JSON). Times are seconds, sizes are bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from planner.jsonio import JsonFileError, read_json, write_json_atomic

PROFILE_SCHEMA_VERSION = 1

# Optimizer state bytes held per parameter byte (SGD without momentum: none; Adam: two moments).
OPTIMIZER_STATE_PER_PARAM_BYTE = {"sgd": 0.0, "adamw": 2.0, "adam": 2.0}


def _int_keys(d: Dict[Any, Any]) -> Dict[int, Any]:
    return {int(k): v for k, v in d.items()}


def _str_keys(d: Dict[int, Any]) -> Dict[str, Any]:
    return {str(k): v for k, v in sorted(d.items())}


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

    def to_json(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "param_bytes": self.param_bytes,
            "forward_s": _str_keys(self.forward_s),
            "backward_s": _str_keys(self.backward_s),
            "saved_bytes": _str_keys(self.saved_bytes),
            "output_bytes": _str_keys(self.output_bytes),
            "nodes": list(self.nodes),
            **({"optimizer_s": dict(self.optimizer_s)} if self.optimizer_s else {}),
        }

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "UnitProfile":
        return cls(
            name=d["name"],
            param_bytes=int(d["param_bytes"]),
            forward_s={k: float(v) for k, v in _int_keys(d["forward_s"]).items()},
            backward_s={k: float(v) for k, v in _int_keys(d["backward_s"]).items()},
            saved_bytes={k: int(v) for k, v in _int_keys(d["saved_bytes"]).items()},
            output_bytes={k: int(v) for k, v in _int_keys(d.get("output_bytes", {})).items()},
            nodes=list(d.get("nodes", [])),
            optimizer_s={str(k): float(v) for k, v in (d.get("optimizer_s") or {}).items()},
        )


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
    def from_json(cls, d: Dict[str, Any]) -> "CutValue":
        return cls(
            name=d["name"],
            kind=d["kind"],
            dtype=d.get("dtype"),
            requires_grad=bool(d.get("requires_grad", False)),
            shape={k: list(v) for k, v in _int_keys(d.get("shape", {})).items()},
            bytes={k: int(v) for k, v in _int_keys(d.get("bytes", {})).items()},
            value=_int_keys(d.get("value", {})),
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
    def from_json(cls, d: Dict[str, Any]) -> "CutProfile":
        return cls(before_unit=int(d["before_unit"]), values=[CutValue.from_json(v) for v in d["values"]])


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
    schema_version: int = PROFILE_SCHEMA_VERSION
    extra: Dict[str, Any] = field(default_factory=dict)
    # b -> (forward, backward) seconds a stage pays once per micro-batch whatever units it holds
    # (a call's fixed cost: Python, autograd's engine start); unit times exclude it. Empty: none.
    stage_overhead_s: Dict[int, Tuple[float, float]] = field(default_factory=dict)

    def stage_overhead(self, b: int) -> Tuple[float, float]:
        """(forward, backward) seconds one stage pays per micro-batch of size b on top of its units."""
        return self.stage_overhead_s.get(b, (0.0, 0.0))

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
        d.update(self.extra)
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Profile":
        if not isinstance(d, dict) or d.get("kind", "profile") != "profile" or "units" not in d:
            raise JsonFileError("this is not a profile file (no 'units'); make one with `planner profile MODEL`")
        version = d.get("schema_version")
        if version != PROFILE_SCHEMA_VERSION:
            raise JsonFileError(
                f"profile schema_version {version!r} is not supported (expected {PROFILE_SCHEMA_VERSION}); "
                "re-run `planner profile` with this version")
        try:
            units = [UnitProfile.from_json(u) for u in d["units"]]
            cuts = [CutProfile.from_json(c) for c in d.get("cuts", [])]
            sizes = [int(b) for b in d["micro_batch_sizes"]]
            overhead = {int(b): (float(o["forward"]), float(o["backward"]))
                        for b, o in (d.get("stage_overhead_s") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise JsonFileError(f"profile is malformed ({type(e).__name__}: {e}); re-run `planner profile`") from e
        if not units:
            raise JsonFileError("profile has no units")
        if len(cuts) != len(units) - 1:
            raise JsonFileError(f"profile has {len(units)} units but {len(cuts)} cuts (expected {len(units) - 1})")
        for u in units:
            for b in sizes:
                if b not in u.forward_s or b not in u.backward_s or b not in u.saved_bytes:
                    raise JsonFileError(f"profile unit {u.name!r} has no measurement at micro-batch size {b}")
        if any(not (0 <= x < float("inf")) for pair in overhead.values() for x in pair):
            raise JsonFileError("profile stage_overhead_s must be seconds >= 0; re-run `planner profile`")
        known = {"schema_version", "kind", "torch_version", "device", "device_name", "threads", "dtype",
                 "capture", "repeats", "model", "micro_batch_sizes", "optimizer_state_bytes_per_param_byte",
                 "units", "cuts", "stage_overhead_s"}
        return cls(
            model=d.get("model", {}),
            micro_batch_sizes=sizes,
            units=units,
            cuts=cuts,
            device=d.get("device", "cpu"),
            device_name=d.get("device_name", ""),
            threads=int(d.get("threads", 1)),
            dtype=d.get("dtype", "float32"),
            torch_version=d.get("torch_version", ""),
            capture=d.get("capture", "fx"),
            repeats=int(d.get("repeats", 5)),
            schema_version=version,
            extra={k: v for k, v in d.items() if k not in known},
            stage_overhead_s=overhead,
        )


def load_profile(path: str) -> Profile:
    return Profile.from_json(read_json(path, what="profile"))


def save_profile(profile: Profile, path: str) -> None:
    write_json_atomic(path, profile.to_json())
