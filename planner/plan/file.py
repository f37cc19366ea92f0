"""The plan file as typed data: `Plan` and its `PlanStage`s, read and checked by `load_plan` (the one
loader: planner commands, `runtime execute/show` and every rank use it) and written by `save_plan`.

A plan is plain JSON (version PLAN_SCHEMA_VERSION), one key per field below, in this order.
`stages` lists the S = p·v stages in model order: the units each runs, and `recv`/`send`, the
values crossing its first and end cut at the plan's micro-batch size (`CutValue.at`); the
planner's predictions sit beside them for comparison. Keys this version does not know are kept
(`extra`) and written back. `Plan.from_json(d).to_json() == d` for every plan `planner solve` writes.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from planner.cost.localsgd import local_sgd_refusal
from planner.cost.memory import OPTIMIZER_MOMENTS, PRECISIONS, SHARDS
from planner.jsonio import JsonFileError, newer_schema, read_json, write_json_atomic
from planner.pipeline.schedule import MAX_MICRO_BATCHES, SCHEDULES, Action
from planner.pipeline.simulate import SimEvent, simulate
from planner.pipeline.stepgraph import Term, Timeline
from planner.pipeline.topology import Topology, TopologyError, instruction_lists, topology_of
from planner.profile.cut_profile import MESSAGE_DTYPES, is_dim_order
from planner.plan.fields import (INT, INT_ROWS, INTS, NAMES, NUMBER, NUMBER_OR_NULL, NUMBERS, OBJECT, REMAKE, TEXT,
                                  VALUES, fields_from_json, fields_to_json, json_field, not_an_object, valid_shape)
from planner.sizes import MAX_LATENCY_S  # an emulated link holds a message or an exchange at most this long

# 2: the prediction is the simulation of the plan's lists with the `step_durations` it carries
# (1 had a closed form, `per_step_s` and no durations)
PLAN_SCHEMA_VERSION = 2
MAX_THREADS = 4096  # a profile's threads per rank (torch.set_num_threads takes a C int)
# step_durations' per-index lists
PER_INDEX_TERMS = ("forward", "backward", "backward_input", "backward_weight", "act", "grad", "reduce", "step")
_MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "total")  # of a stage's memory_bytes, always written

@dataclass
class PlanStage:
    """One entry of `stages`: units [first_unit, end_unit), run as stage `index` on the pipeline
    ranks device .. device + replicas - 1. Times in seconds per micro-batch, bytes per device."""

    index: int = json_field(INT)
    device: Optional[int] = json_field(INT, required=False, default=None)  # absent: the topology's default
    units: List[str] = json_field(NAMES, default_factory=list)
    first_unit: int = json_field(INT, default=0)
    end_unit: int = json_field(INT, default=0)
    recompute: List[str] = json_field(NAMES, required=False, default_factory=list)  # units run again in backward
    forward_s: float = json_field(NUMBER, default=0.0)
    backward_s: float = json_field(NUMBER, default=0.0)  # recomputed forwards included
    # zero-bubble schedules only: the backward's input-gradient and weight-gradient parts
    backward_input_s: Optional[float] = json_field(NUMBER, required=False, default=None)
    backward_weight_s: Optional[float] = json_field(NUMBER, required=False, default=None)
    comm_s: float = json_field(NUMBER, default=0.0)  # transfers charged to this stage
    time_s: float = json_field(NUMBER, default=0.0)
    extra_s: float = json_field(NUMBER, required=False, default=0.0)  # once per step: all-reduce, tied weights
    in_flight: int = json_field(INT, default=1)  # micro-batches whose activations it holds at once
    # params, grads, optimizer, activations, total (this stage) and device_total (its device)
    memory_bytes: Dict[str, float] = json_field(OBJECT, default_factory=dict)
    memory_cap_bytes: Optional[float] = json_field(NUMBER_OR_NULL, required=False, default=None)
    bubble_fraction: Optional[float] = json_field(NUMBER, required=False, default=None)  # of its device
    recv: List[Dict[str, Any]] = json_field(VALUES, default_factory=list)
    send: List[Dict[str, Any]] = json_field(VALUES, default_factory=list)
    replicas: Optional[int] = json_field(INT, required=False, default=None)  # only in replicated plans; absent: 1
    extra: Dict[str, Any] = field(default_factory=dict)  # keys this version does not know

    @property
    def replica_count(self) -> int:
        """r: the pipeline ranks running this stage (its micro-batches round-robin)."""
        return 1 if self.replicas is None else self.replicas

    def activation_bytes_sent(self) -> int:
        """Bytes of tensors this stage sends forward per micro-batch."""
        return sum(int(v.get("bytes", 0)) for v in self.send if v["kind"] == "tensor")

    def gradient_bytes_sent(self) -> int:
        """Bytes of gradients this stage sends back per micro-batch (those of its received tensors)."""
        return sum(int(v.get("bytes", 0)) for v in self.recv if v["kind"] == "tensor" and v.get("requires_grad"))


@dataclass
class Plan:
    """A plan: the model, how its batch is split, the schedule, the stages, and the prediction.

    Data-parallel replicas d, stages per pipeline rank v and pipeline ranks p (per replica; the sum
    of the stages' replicas when some stage is replicated) are `data_parallel`, `virtual_stages`
    and `pipeline_stages`; global_batch = d · num_micro_batches · micro_batch_size."""

    schema_version: int = json_field(INT, default=PLAN_SCHEMA_VERSION)
    kind: str = json_field(TEXT, default="plan")
    model: Dict[str, Any] = json_field(OBJECT, default_factory=dict)  # {"entry", "args", "seed"}
    profile: Dict[str, Any] = json_field(OBJECT, default_factory=dict)  # which profile, measured under what
    schedule: str = json_field(TEXT, default="1f1b")
    optimizer: str = json_field(TEXT, default="sgd")
    # planner.cost.memory: the dtypes parameters, gradients and state are kept in, how the stages'
    # data-parallel holders shard them (ZeRO), and the bytes kept free on every device
    precision: str = json_field(TEXT, required=False, default="fp32")
    shard: str = json_field(TEXT, required=False, default="none")
    reserve_bytes: float = json_field(NUMBER, required=False, default=0.0)
    global_batch: int = json_field(INT, default=1)
    data_parallel: int = json_field(INT, required=False, default=1)
    # H: 1, the replicas all-reduce gradients every step; H > 1, local SGD: each replica trains alone
    # and they average their models after every H-th step (planner.cost.localsgd); absent: 1
    sync_every: int = json_field(INT, required=False, default=1)
    # local SGD only: seconds of one averaging on the slowest rank; step_durations' "reduce" charges
    # it / sync_every per step
    averaging_s: Optional[float] = json_field(NUMBER, required=False, default=None)
    pipeline_stages: int = json_field(INT, required=False, default=0)  # 0 in code: derive from the stages
    virtual_stages: int = json_field(INT, required=False, default=1)
    micro_batch_size: int = json_field(INT, default=1)
    num_micro_batches: int = json_field(INT, default=1)  # per data-parallel replica
    memory_per_device_bytes: Optional[float] = json_field(NUMBER_OR_NULL, default=None)
    bandwidth_bytes_per_s: Optional[float] = json_field(NUMBER_OR_NULL, default=None)
    latency_s: Optional[float] = json_field(NUMBER_OR_NULL, default=None)
    step_overhead_s: float = json_field(NUMBER, required=False, default=0.0)  # added to the simulated step
    message_s: float = json_field(NUMBER, required=False, default=0.0)  # the engine's cost per message, each side
    # every duration of the step graph (planner.cost.model): {"forward": [s per stage], "backward": [...],
    # "act": [s per boundary], "grad": [...], "message": s, "reduce": [s per pipeline rank], "step": [...],
    # "collectives": [{"term": [...], "ranks": [...], "seconds": s}]}
    step_durations: Dict[str, Any] = json_field(OBJECT, default_factory=dict)
    # stage boundaries (j: between stages j and j + 1) whose messages cross a link the runtime emulates
    # (planner.cost.cluster: a link with "emulate": true); each message is held for step_durations' time
    emulated_boundaries: List[int] = json_field(INTS, required=False, default_factory=list)
    # where each (replica, pipeline rank) runs: placement[replica][pipeline rank] = the global rank
    # (device index; planner.cost.placement); absent: replica · p + rank
    placement: Optional[List[List[int]]] = json_field(INT_ROWS, required=False, default=None)
    # seconds each pipeline rank holds after its data-parallel exchange: the part of it planned over an
    # emulated link (runtime/emulation.py); absent: none
    emulated_exchange_s: Optional[List[float]] = json_field(NUMBERS, required=False, default=None)
    stages: List[PlanStage] = json_field(None, default_factory=list)
    predicted_iteration_s: float = json_field(NUMBER, default=0.0)
    bubble_fraction: float = json_field(NUMBER, default=0.0)
    solver: Dict[str, Any] = json_field(OBJECT, default_factory=dict)  # method, backend, status, objective, bound, gap
    extra: Dict[str, Any] = field(default_factory=dict)  # keys this version does not know

    @property
    def replicated(self) -> bool:
        return any(st.replica_count > 1 for st in self.stages)

    @property
    def flush_subnormals(self) -> bool:
        """Whether every rank flushes subnormal floats, as the profile was timed (planner.profile.subnormal;
        absent in older plans and those of analytic profiles: False)."""
        return self.profile.get("flush_subnormals", False) is True

    def topology(self) -> Topology:
        """Where every stage runs (planner.pipeline.topology); TopologyError if inconsistent."""
        return topology_of([st.device for st in self.stages], [st.replica_count for st in self.stages],
                           self.schedule, self.num_micro_batches, self.virtual_stages, self.pipeline_stages or None,
                           self.data_parallel, self.placement)

    def instruction_lists(self) -> List[List[Action]]:
        """Every pipeline rank's instruction list, as the runtime executes them."""
        return instruction_lists(self.topology(), self.schedule, self.num_micro_batches)

    def step_terms(self) -> Tuple[Dict[Term, float], List[Tuple[Term, Tuple[int, ...]]]]:
        """(duration per term, collectives in run order) of the step the planner predicted."""
        raw = self.step_durations
        value: Dict[Term, float] = {("message",): float(raw.get("message", 0.0))}
        for kind in PER_INDEX_TERMS:
            for i, seconds in enumerate(raw.get(kind, [])):
                value[(kind, i)] = float(seconds)
        collectives = []
        for entry in raw.get("collectives", []):
            term = tuple(entry["term"])
            value[term] = float(entry["seconds"])
            collectives.append((term, tuple(int(r) for r in entry["ranks"])))
        return value, collectives

    def simulate_step(self) -> Tuple[Timeline, List[SimEvent]]:
        """The plan's lists simulated with its durations: the predicted step, without the overhead
        (predicted_iteration_s = its step time + step_overhead_s)."""
        value, collectives = self.step_terms()
        return simulate(self.instruction_lists(), value, self.topology().rank_running, collectives)

    def precision_mismatch(self, precision: str) -> Optional[str]:
        """The one-line refusal when a run asks another precision than the plan was made for (its
        memory would not be the planned one), else None."""
        if precision == self.precision:
            return None
        return (f"the plan was made for precision {self.precision} but the run asks {precision}: run with "
                f"--precision {self.precision}, or re-plan with `planner solve --precision {precision}`")

    def digest(self) -> str:
        """sha256 of the plan's JSON (keys sorted): ranks compare it, checkpoints record it."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    # --- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> Dict[str, Any]:
        out = fields_to_json(self)
        if self.sync_every == 1:  # the default: a plan without local SGD reads (and hashes) as before it existed
            del out["sync_every"]
        out["stages"] = [fields_to_json(st) for st in self.stages]
        return out

    @classmethod
    def from_json(cls, d: Any, where: str = "plan") -> "Plan":
        """The plan in `d`, checked: JsonFileError (one line, saying how to fix it) otherwise."""
        if not isinstance(d, dict) or d.get("kind") != "plan":
            raise JsonFileError(f"{where} is not a plan file (no \"kind\": \"plan\"); {REMAKE}")
        if d.get("schema_version") != PLAN_SCHEMA_VERSION:
            raise JsonFileError(f"{where} has schema_version {d.get('schema_version')!r}, expected "
                                f"{PLAN_SCHEMA_VERSION}; {newer_schema(d.get('schema_version'), PLAN_SCHEMA_VERSION)}"
                                f"{REMAKE}")
        values = fields_from_json(cls, d, where)
        if not isinstance(values["stages"], list) or not values["stages"]:
            raise JsonFileError(f"{where} has no stages; {REMAKE}")
        values["stages"] = [PlanStage(**fields_from_json(PlanStage, st, f"{where} stage {i}"))
                            if isinstance(st, dict) else not_an_object(f"{where} stage {i}")
                            for i, st in enumerate(values["stages"])]
        plan = cls(**values)
        for st, raw in zip(plan.stages, d["stages"]):
            if "memory_cap_bytes" not in raw:  # older files: the plan's cap
                st.memory_cap_bytes = plan.memory_per_device_bytes
        plan._check(where)
        return plan

    def _check(self, where: str) -> None:
        for i, st in enumerate(self.stages):
            if st.index != i:
                raise JsonFileError(f"{where} stage {i} has index {st.index!r}; {REMAKE}")
        self._check_units(where)
        self._check_values(where)
        if self.schedule not in SCHEDULES:
            raise JsonFileError(f"{where} has schedule {self.schedule!r}, not one of {', '.join(SCHEDULES)}; {REMAKE}")
        for name, value, known in (("precision", self.precision, PRECISIONS), ("shard", self.shard, SHARDS)):
            if value not in known:
                raise JsonFileError(f"{where} has {name} {value!r}, not one of {', '.join(known)}; {REMAKE}")
        self._check_sync(where)
        if not 0 <= self.reserve_bytes < float("inf"):
            raise JsonFileError(f"{where} has reserve_bytes {self.reserve_bytes!r}: bytes >= 0; {REMAKE}")
        try:
            topology = self.topology()
        except TopologyError as e:
            raise JsonFileError(f"{where}: {str(e).split('; re-run')[0]}; {REMAKE}") from None
        d, m, b = self.data_parallel, self.num_micro_batches, self.micro_batch_size
        if m > MAX_MICRO_BATCHES:
            raise JsonFileError(f"{where} has {m} micro-batches a step, more than {MAX_MICRO_BATCHES}; {REMAKE}")
        if min(m, b) < 1 or d * m * b != self.global_batch:
            raise JsonFileError(f"{where}: the global batch {self.global_batch} is not {d} replica(s) x {m} "
                                f"micro-batches x micro-batch size {b}; {REMAKE}")
        try:
            value, collectives = self.step_terms()
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError):  # (int(inf): a rank of Infinity)
            raise JsonFileError(f"{where} has malformed step_durations; {REMAKE}") from None
        if any(not 0 <= x < float("inf") for x in value.values()):
            raise JsonFileError(f"{where}: step_durations must be finite seconds >= 0; {REMAKE}")
        ranks = [r for entry in self.step_durations.get("collectives", []) for r in entry["ranks"]]
        if any(not (isinstance(r, int) and not isinstance(r, bool) and 0 <= r < topology.pipeline_ranks) for r in ranks):
            raise JsonFileError(f"{where}: step_durations' collectives name ranks outside 0..{topology.pipeline_ranks - 1}; "
                                f"{REMAKE}")
        if any(max(value.get(("act", j), 0.0), value.get(("grad", j), 0.0)) > MAX_LATENCY_S
               for j in self.emulated_boundaries):
            raise JsonFileError(f"{where}: an emulated link would hold a message over {MAX_LATENCY_S:.0f} s "
                                f"(step_durations); {REMAKE}")
        boundaries = len(self.stages) - 1
        if any(not 0 <= j < boundaries for j in self.emulated_boundaries):
            raise JsonFileError(f"{where} has emulated_boundaries {self.emulated_boundaries!r}: stage boundaries "
                                f"0..{boundaries - 1}; {REMAKE}")
        if self.emulated_exchange_s and (len(self.emulated_exchange_s) != topology.pipeline_ranks or
                                         any(not 0 <= x <= MAX_LATENCY_S for x in self.emulated_exchange_s)):
            raise JsonFileError(f"{where} has emulated_exchange_s {self.emulated_exchange_s!r}: seconds "
                                f"0..{MAX_LATENCY_S:.0f}, one "
                                f"per pipeline rank ({topology.pipeline_ranks}); {REMAKE}")
        if not self.pipeline_stages:  # older files: derived from the stages
            self.pipeline_stages = topology.pipeline_ranks
        for st, device in zip(self.stages, topology.stage_rank):
            if st.device is None:
                st.device = device

    def _check_values(self, where: str) -> None:
        """What the runtime and the tools compute with: the model to build (an entry, none for an
        imported profile's plan), the optimizer, the link, and every stage's times and bytes."""
        entry, args, seed = self.model.get("entry"), self.model.get("args", {}), self.model.get("seed", 0)
        entry_ok = entry is None or isinstance(entry, str) and entry != ""
        seed_ok = isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2 ** 63
        if not (entry_ok and isinstance(args, dict) and seed_ok):
            raise JsonFileError(f"{where} has model {self.model!r}: an entry name, args (an object) and a seed "
                                f"(an integer >= 0); {REMAKE}")
        threads = self.profile.get("threads", 1)
        if not (isinstance(threads, int) and not isinstance(threads, bool) and 0 <= threads <= MAX_THREADS):
            raise JsonFileError(f"{where} has profile.threads {threads!r}: an integer 0..{MAX_THREADS}; {REMAKE}")
        flush = self.profile.get("flush_subnormals", False)
        if not isinstance(flush, bool):  # what every rank computes under (planner.profile.subnormal)
            raise JsonFileError(f"{where} has profile.flush_subnormals {flush!r}: true or false; {REMAKE}")
        kernel, version = self.profile.get("host_kernel_s"), self.profile.get("torch_version")
        if kernel is not None and not (NUMBER[0](kernel) and 0 <= kernel < math.inf):
            raise JsonFileError(f"{where} has profile.host_kernel_s {kernel!r}: seconds, a finite number >= 0; "
                                f"{REMAKE}")
        if version is not None and not isinstance(version, str):
            raise JsonFileError(f"{where} has profile.torch_version {version!r}: a version string; {REMAKE}")
        for key in ("objective", "bound", "gap", "seconds", "requested_gap"):  # what planner show prints
            number = self.solver.get(key)
            if number is not None and not NUMBER[0](number):
                raise JsonFileError(f"{where} has solver.{key} {number!r}: a number or null; {REMAKE}")
        if self.optimizer not in OPTIMIZER_MOMENTS:  # what the memory model counts
            raise JsonFileError(f"{where} has optimizer {self.optimizer!r}, not one of {', '.join(OPTIMIZER_MOMENTS)}; "
                                f"{REMAKE}")
        positive = {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                    "memory_per_device_bytes": self.memory_per_device_bytes}
        at_least_zero = {"latency_s": self.latency_s, "step_overhead_s": self.step_overhead_s,
                         "message_s": self.message_s, "predicted_iteration_s": self.predicted_iteration_s}
        for k, st in enumerate(self.stages):
            for name in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "comm_s", "time_s",
                         "extra_s", "memory_cap_bytes"):
                at_least_zero[f"stage {k} {name}"] = getattr(st, name)
            # what a rank sends and receives: its message layouts
            for side, values in (("recv", st.recv), ("send", st.send)):
                for v in values:
                    if v["kind"] == "tensor" and not (v.get("dtype") in MESSAGE_DTYPES and valid_shape(v.get("shape"))
                                                      and isinstance(v.get("requires_grad", False), bool)):
                        raise JsonFileError(f"{where} stage {k} {side} value {v['name']!r} has no dtype (one of "
                                            f"{', '.join(MESSAGE_DTYPES)}), shape (sizes) and requires_grad; {REMAKE}")
                    for key in ("order", "grad_order"):
                        order = v.get(key) if v["kind"] == "tensor" else None
                        if order is not None and not is_dim_order(order, len(v["shape"])):
                            raise JsonFileError(f"{where} stage {k} {side} value {v['name']!r} has {key} "
                                                f"{order!r}, not a permutation of its {len(v['shape'])} "
                                                f"dimensions; {REMAKE}")
            # what the tables, the report and the memory checks read
            missing = [key for key in _MEMORY_KEYS if key not in st.memory_bytes]
            if missing:
                raise JsonFileError(f"{where} stage {k} has no memory_bytes {missing[0]!r}; {REMAKE}")
            for key, value in st.memory_bytes.items():
                if not (NUMBER[0](value) and 0 <= value < math.inf):
                    raise JsonFileError(f"{where} has stage {k} memory_bytes {key!r} {value!r}: bytes, a finite "
                                        f"number >= 0; {REMAKE}")
        for k, (before, after) in enumerate(zip(self.stages, self.stages[1:])):
            if [_layout(v) for v in before.send] != [_layout(v) for v in after.recv]:
                raise JsonFileError(f"{where}: stage {k} sends other values than stage {k + 1} receives (names, "
                                    f"dtypes, shapes, requires_grad); {REMAKE}")
        for name, value in positive.items():
            if value is not None and not 0 < value < math.inf:
                raise JsonFileError(f"{where} has {name} {value!r}: a finite number > 0; {REMAKE}")
        for name, value in at_least_zero.items():
            if value is not None and not 0 <= value < math.inf:
                raise JsonFileError(f"{where} has {name} {value!r}: a finite number >= 0; {REMAKE}")

    def _check_units(self, where: str) -> None:
        """Each stage runs one or more units, the next after the previous stage's ([first_unit,
        end_unit), named once each in the plan), and recomputes only units of its own."""
        start, seen = 0, set()
        for i, st in enumerate(self.stages):
            if not st.units or st.first_unit != start or st.end_unit - st.first_unit != len(st.units):
                raise JsonFileError(f"{where} stage {i} runs units [{st.first_unit}, {st.end_unit}) and names "
                                    f"{len(st.units)}: every stage runs at least one unit, from where the stage "
                                    f"before it ends ({start}); {REMAKE}")
            twice = next((u for u in st.units if u in seen or st.units.count(u) > 1), None)
            if twice is not None:
                raise JsonFileError(f"{where} names unit {twice!r} twice; {REMAKE}")
            seen.update(st.units)
            alien = next((u for u in st.recompute if u not in st.units), None)
            if alien is not None:
                raise JsonFileError(f"{where} stage {i} recomputes {alien!r}, not one of its units; {REMAKE}")
            if st.in_flight < 0:  # the report divides the planned activations by it
                raise JsonFileError(f"{where} stage {i} has in_flight {st.in_flight}: micro-batches held at once, "
                                    f">= 0; {REMAKE}")
            start = st.end_unit

    def _check_sync(self, where: str) -> None:
        """Local SGD needs replicas to average, and planner.cost.localsgd.local_sgd_refusal's rule."""
        H = self.sync_every
        if H < 1:
            raise JsonFileError(f"{where} has sync_every {H}: the averaging period is at least 1 step; {REMAKE}")
        if H == 1:
            return
        if self.data_parallel < 2:
            raise JsonFileError(f"{where} has sync_every {H} with one data-parallel replica: local SGD averages "
                                f"replicas; {REMAKE} --devices N --local-sgd-max H")
        refusal = local_sgd_refusal(H, self.shard, self.replicated, self.placement is not None)
        if refusal:
            raise JsonFileError(f"{where} has sync_every {H}: {refusal}; {REMAKE}")


def _layout(value: Dict[str, Any]) -> Tuple:
    """A message value as both sides must agree on it."""
    return (value.get("name"), value.get("kind"), value.get("dtype"), str(value.get("shape")),
            value.get("requires_grad", False), str(value.get("order")), str(value.get("grad_order")))


def load_plan(path: str) -> Plan:
    """Read and check a plan file."""
    return Plan.from_json(read_json(path, what="plan"), where=f"plan {path!r}")


def save_plan(plan: Plan, path: str) -> None:
    write_json_atomic(path, plan.to_json())
