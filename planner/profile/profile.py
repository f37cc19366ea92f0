"""The profile file: what `planner profile` measured, as typed data.

A profile describes a model cut into L ordered partition units (planner.profile.unit_profile) and
the values crossing each cut between them (planner.profile.cut_profile).

Per-micro-batch-size numbers are dicts keyed by the micro-batch size (int in memory, str in
JSON). Times are seconds, sizes are bytes. Reading a file checks it (planner.profile.reader's
rules): every command that takes a profile refuses a bad one in one line naming the first bad field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from planner.jsonio import JsonFileError, newer_schema, read_json, write_json_atomic
from planner.sizes import DTYPE_BYTES
from planner.profile.cut_profile import MESSAGE_DTYPES, CutProfile, CutValue  # noqa: F401  (importable from here too)
from planner.profile.reader import MAX_SECONDS, Reader, show, str_keys  # noqa: F401
from planner.profile.unit_profile import NAMED_STORAGE_FIELDS, UnitProfile  # noqa: F401

PROFILE_SCHEMA_VERSION = 2  # the newest this code reads and writes
# a profile measured under a precision (Profile.precision) is written as version 2: a planner that
# reads version 1 only would take its bytes for the model's dtype's and scale them again; every
# other profile stays version 1, which older planners read
PLAIN_SCHEMA_VERSION = 1
MEASURED_PRECISIONS = ("bf16-mixed",)  # Profile.precision's values (None: as built)
PROFILE_PRECISIONS = ("fp32",) + MEASURED_PRECISIONS  # what a profile is measured under: as built, or one of those

# Optimizer state bytes held per parameter byte (SGD without momentum: none; Adam: two moments).
OPTIMIZER_STATE_PER_PARAM_BYTE = {"sgd": 0.0, "adamw": 2.0, "adam": 2.0}
# Profile.split_overhead_s's parts, as its JSON names them
_SPLIT_OVERHEAD = ("first_input", "input", "weight")


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
    # (runtime.engine_probe: its per-action work, measured in a two-stage pipeline); (0, 0): not measured
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
    def flush_subnormals(self) -> bool:
        """Whether the units were timed with subnormal floats flushed to zero (planner.profile.subnormal),
        as the plan's ranks then compute; False for analytic and older profiles (they computed on them)."""
        return bool((self.extra.get("measured_under") or {}).get("flush_subnormals"))

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
            d["weight_walk_s"] = str_keys(self.weight_walk_s)
        if self.precision:
            d["precision"] = self.precision
        d.update(self.extra)
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any], source: str = "profile") -> "Profile":
        """The profile in `d`, checked (see Reader): a JsonFileError names the first bad field."""
        if not isinstance(d, dict) or d.get("kind", "profile") != "profile" or "units" not in d:
            raise JsonFileError("this is not a profile file (no 'units'); make one with `planner profile MODEL`")
        version = d.get("schema_version")
        if isinstance(version, bool) or version not in (PLAIN_SCHEMA_VERSION, PROFILE_SCHEMA_VERSION):
            raise JsonFileError(
                f"profile schema_version {version!r} is not supported (expected {PLAIN_SCHEMA_VERSION} or "
                f"{PROFILE_SCHEMA_VERSION}); "
                f"{newer_schema(version, PROFILE_SCHEMA_VERSION)}re-run `planner profile` with this version")
        read = Reader(source, [])
        precision = d.get("precision")
        if precision is not None and precision not in MEASURED_PRECISIONS:
            raise read.error("precision", f"is {show(precision)}: expected {' or '.join(MEASURED_PRECISIONS)} "
                             "(or no field: measured as built)")
        if precision is not None and version < PROFILE_SCHEMA_VERSION:
            raise read.error("precision", f"needs schema_version {PROFILE_SCHEMA_VERSION} (the file says {version})")
        sizes = d.get("micro_batch_sizes")
        if not isinstance(sizes, list) or not sizes or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes) or len(set(sizes)) < len(sizes):
            raise read.error("micro_batch_sizes", f"is {show(sizes)}: expected distinct positive integers")
        read.sizes = sizes
        if not isinstance(d["units"], list) or not d["units"]:
            raise read.error("units", f"is {show(d['units'])}: expected a list of at least one unit")
        units = [UnitProfile.from_json(u, read, f"units[{i}]") for i, u in enumerate(d["units"])]
        first_of: Dict[str, int] = {}
        for i, u in enumerate(units):
            if first_of.setdefault(u.name, i) != i:
                raise read.error(f"units[{i}].name", f"{u.name!r} repeats units[{first_of[u.name]}].name: "
                                 "unit names are unique")
            for name in ("inner_weight_bytes", "inner_kept_bytes"):  # sources: units before it, the first excepted
                for b, inner in getattr(u, name).items():
                    wrong = next((key for key in inner if not (key.isdigit() and 1 <= int(key) < i)), None)
                    if wrong is not None:
                        raise read.error(f'units[{i}].{name}["{b}"]', f"names unit {wrong!r}: a source is the "
                                         f"index of a unit before it other than the first (1..{i - 1})")
            wrong = next((name for name, T in u.inner_seed_sources.items() if not 1 <= T < i), None)
            if wrong is not None:
                raise read.error(f'units[{i}].inner_seed_sources["{wrong}"]', f"is {u.inner_seed_sources[wrong]}: a "
                                 f"source is the index of a unit before it other than the first (1..{i - 1})")
        cuts_json = d.get("cuts", [])
        if not isinstance(cuts_json, list) or len(cuts_json) != len(units) - 1:
            found = len(cuts_json) if isinstance(cuts_json, list) else show(cuts_json)
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
        _check_extra(read, d, {u.name: u.param_bytes for u in units})
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
            threads=read.count(d.get("threads", 1), "threads", "thread counts"),
            dtype=_dtype(read, d.get("dtype", "float32")),
            torch_version=d.get("torch_version", ""),
            capture=d.get("capture", "fx"),
            repeats=read.count(d.get("repeats", 5), "repeats", "repeat counts"),
            extra={k: v for k, v in d.items() if k not in known},
            stage_overhead_s=overhead,
            engine_overhead_s=engine_overhead,
            split_overhead_s=split,
            weight_walk_s=walk,
            precision=precision,
        )


def _dtype(read: Reader, value: Any) -> str:
    """The parameters' dtype (planner.sizes.DTYPE_BYTES)."""
    if not isinstance(value, str) or value not in DTYPE_BYTES:
        raise read.error("dtype", f"is {show(value)}: expected one of {', '.join(DTYPE_BYTES)}")
    return value


def _check_extra(read: Reader, d: Dict[str, Any], param_bytes: Dict[str, int]) -> None:
    """The optional parts a solve reads: tied parameters (each unit's param_bytes counts the ties it uses,
    so they never add up to more), the measured link, a calibration."""
    shared = d.get("shared_parameters") or []
    if not isinstance(shared, list):
        raise read.error("shared_parameters", "is not a list")
    tied: Dict[str, int] = {}
    for i, entry in enumerate(shared):
        where = f"shared_parameters[{i}]"
        entry = read.table(entry, where)
        size = read.count(entry.get("bytes"), f"{where}.bytes")
        units = entry.get("units")
        if not isinstance(units, list) or any(u not in param_bytes for u in units):
            raise read.error(f"{where}.units", f"is {show(units)}: expected names of the profile's units")
        for u in dict.fromkeys(units):  # each unit once, in the entry's order
            tied[u] = tied.get(u, 0) + size
            if tied[u] > param_bytes[u]:
                raise read.error(f"{where}.bytes", f"brings the tied parameters unit {u!r} uses to {tied[u]} bytes, "
                                 f"more than its param_bytes ({param_bytes[u]}), which count them")
    for part in ("link", "calibration"):
        fields = d.get(part) or {}
        read.table(fields, part)
        if fields.get("bandwidth_bytes_per_s") is not None:
            where = f"{part}.bandwidth_bytes_per_s"
            if not read.number(fields["bandwidth_bytes_per_s"], where, "a bandwidth is finite and > 0") > 0:
                raise read.error(where, "is 0: a bandwidth is finite and > 0")
        for key in ("latency_s", "step_overhead_s", "message_s", "transport_message_s"):
            if fields.get(key) is not None:
                read.seconds(fields[key], f"{part}.{key}")
        if fields.get("runs") is not None:  # the runs a calibration took (planner calibrate adds to it)
            read.number(fields["runs"], f"{part}.runs", "a count of runs is a whole number >= 0", 1e9)
            if fields["runs"] != int(fields["runs"]):
                raise read.error(f"{part}.runs", f"is {show(fields['runs'])}: a count of runs is a whole number >= 0")
    analytic = read.table(d.get("analytic") or {}, "analytic")  # planner.profile.analytic_profile's record
    spec = read.table(analytic.get("device_spec") or {}, "analytic.device_spec")
    if spec.get("reserve_bytes") is not None:  # the bytes kept free on every device (planner.cost.memory)
        read.count(spec["reserve_bytes"], "analytic.device_spec.reserve_bytes")
    model = read.table(d.get("model") or {}, "model")  # the plan copies its entry, args and seed
    entry, args, seed = model.get("entry"), model.get("args", {}), model.get("seed", 0)
    if entry is not None and not (isinstance(entry, str) and entry):
        raise read.error("model.entry", f"is {entry!r}, not a model entry (builtin:NAME, package.module:function)")
    read.table(args, "model.args")  # null too: the plan's reader refuses it
    version = d.get("torch_version")  # the plan copies it, and its reader takes a string only
    if version is not None and not isinstance(version, str):
        raise read.error("torch_version", f"is {show(version)}: expected a version string")
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 63):
        raise read.error("model.seed", f"is {seed!r}, not an integer >= 0")
    measured_under = d.get("measured_under") or {}
    read.table(measured_under, "measured_under")
    kernel = read.table(measured_under.get("host_kernel") or {}, "measured_under.host_kernel")
    if kernel.get("mean_s") is not None:  # runs compare their own kernel's time with it
        read.seconds(kernel["mean_s"], "measured_under.host_kernel.mean_s")
    flush = measured_under.get("flush_subnormals")
    if flush is not None and not isinstance(flush, bool):  # the plan's ranks compute as it says
        raise read.error("measured_under.flush_subnormals", f"is {show(flush)}: expected true or false")
    rhythm = (d.get("link") or {}).get("rhythm")
    if rhythm is not None:  # planner.profile.rhythm's record; planner solve reads its latency
        read.table(rhythm, "link.rhythm")
        for key in ("latency_s", "forward_s", "backward_s"):
            read.seconds(rhythm.get(key), f"link.rhythm.{key}")
        if rhythm.get("message_s") is not None:  # the per-operation cost read from it (older profiles lack it)
            read.seconds(rhythm["message_s"], "link.rhythm.message_s")
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
