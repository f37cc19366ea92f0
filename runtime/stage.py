"""Build one rank's stages from a plan: rebuild the model, re-capture it, cut out the stages.

Every rank builds the full spec after `torch.manual_seed(seed)` (identical weights everywhere),
captures the same graph the profile was made from, and checks that the graph still has the
plan's units and cut values before cutting out its own stages as fx GraphModules.

A stage whose plan entry marks units for recomputation runs as a chain of segments: each
recomputed unit alone under `torch.utils.checkpoint` (only its inputs are kept; its forward
runs again in backward, its buffers put back afterwards: BatchNorm's running statistics are
updated once per micro-batch, as without recomputation), the other units fused into segments.
"""
from __future__ import annotations

import contextlib
import weakref

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from planner.model.capture import CapturedModel, capture
from planner.model.example import EXAMPLE_BATCH_SIZE
from planner.model.entry import build_spec
from planner.model.forward_state import pipeline_spec
from planner.model.running_stats import state_writers
from planner.model.spec import ModelSpec
from planner.model.stage_graph import StageIO
from planner.pipeline.topology import Topology
from planner.plan.file import Plan
from planner.model.casts import recast_model
from planner.model.meta import parameters_on_meta, to_meta
from runtime.initstate import InitState, materialise, meta_example, model_names, release, unused_note


class PlanMismatchError(RuntimeError):
    """The model no longer matches the plan (changed code or arguments since profiling)."""


@dataclass
class Segment:
    module: fx.GraphModule
    io: StageIO
    recompute: bool


class SegmentedStage(nn.Module):
    """A plan stage: forward(*inputs, *received) -> tuple(sent) or the model output.

    Runs its segments in order, keeping every value by name, so a recomputed unit can sit
    anywhere in the stage.
    """

    def __init__(self, segments: List[Segment], io: StageIO):
        super().__init__()
        self.segments = segments
        self.io = io
        self.parts = nn.ModuleList(s.module for s in segments)  # registers parameters for .to()/state

    def forward(self, *args):
        if len(self.segments) == 1 and not self.segments[0].recompute:
            return self.segments[0].module(*args)
        values = dict(zip(self.io.inputs + self.io.received, args))
        out: Any = None
        for seg in self.segments:
            seg_args = [values[name] for name in seg.io.inputs + seg.io.received]
            if seg.recompute:
                out = checkpoint(seg.module, *seg_args, use_reentrant=False,
                                 context_fn=BuffersAsInForward(seg.module).contexts)
            else:
                out = seg.module(*seg_args)
            if not seg.io.is_last:
                values.update(zip(seg.io.sent, out))
        if self.io.is_last:
            return out
        return tuple(values[name] for name in self.io.sent)


class BuffersAsInForward:
    """A recomputed segment's buffers, seen by the recomputation as its forward saw them and left as
    the forward (and every later one) left them: what the forward writes into buffers (BatchNorm's
    running statistics, spectral_norm's power-iteration vectors) is written once per micro-batch,
    and a forward that reads them (spectral_norm) is recomputed on the values it read. The forward
    keeps a copy of each buffer it writes from before it ran: which ones is learned per module (the
    first forward copies all and keeps those that changed; BatchNorm's kernel moves no version
    counter, so values are compared). `contexts()` is checkpoint's context_fn pair."""

    _written: "weakref.WeakKeyDictionary[nn.Module, Set[str]]" = weakref.WeakKeyDictionary()

    def __init__(self, module: nn.Module):
        self.module = module
        self.before: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def contexts(self) -> Tuple[Any, Any]:
        return self._Forward(self), self._Recomputation(self)

    class _Forward:
        def __init__(self, owner: "BuffersAsInForward"):
            self.owner, self.copies = owner, []

        def __enter__(self) -> None:
            known = BuffersAsInForward._written.get(self.owner.module)
            self.copies = [(name, b, b.detach().clone()) for name, b in self.owner.module.named_buffers()
                           if known is None or name in known]

        def __exit__(self, *exc: Any) -> None:
            changed = [(name, b, value) for name, b, value in self.copies if not torch.equal(b, value)]
            written = BuffersAsInForward._written.setdefault(self.owner.module, set())
            written.update(name for name, _, _ in changed)
            self.owner.before = [(b, value) for name, b, value in self.copies if name in written]
            self.copies = []

    class _Recomputation:
        def __init__(self, owner: "BuffersAsInForward"):
            self.owner, self.now = owner, []

        def __enter__(self) -> None:
            with torch.no_grad():
                self.now = [(b, b.detach().clone()) for b, _ in self.owner.before]
                for buffer, value in self.owner.before:
                    buffer.copy_(value)

        def __exit__(self, *exc: Any) -> None:
            with torch.no_grad():
                for buffer, value in self.now:
                    buffer.copy_(value)
            self.now = []  # (`before` stays: a zero-bubble weight part recomputes again)


@dataclass
class RankStage:
    """One plan stage as this rank runs it."""

    index: int  # the stage's index g in the plan
    num_stages: int
    module: nn.Module
    io: StageIO
    recv: List[Dict[str, Any]]  # the plan's descriptions of the values crossing the first cut
    send: List[Dict[str, Any]]  # ... and of those crossing the end cut
    # model state_dict keys this stage saves -> the key of the same tensor in the stage's own state
    # (an aliased parameter, one tensor under several names, is saved under each of them), or None
    # for an entry no stage uses (saved by stage 0 at its initial value)
    state_sources: Dict[str, Optional[str]]
    model_inputs: List[str]  # the model's forward arguments (fx placeholder names), in order
    recompute: List[str] = field(default_factory=list)

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass
class RankModel:
    spec: ModelSpec
    stages: List[RankStage]  # the stages this rank runs, in model order
    # Parameters used by stages on several pipeline ranks (tied weights): canonical name ->
    # (parameter on this rank, pipeline ranks holding it). Their gradients are summed across those
    # ranks, in every data-parallel replica, before the optimizer step.
    tied: Dict[str, Tuple[nn.Parameter, Tuple[int, ...]]]
    tied_groups: List[Tuple[str, Tuple[int, ...]]]  # every tie in the plan, same order on all ranks
    # A batch's `inputs` (positional, maybe ending in a keyword dict) as a list aligned with the
    # graph's placeholders (RankStage.model_inputs).
    input_values: Callable[[Any], List[Any]] = lambda inputs: list(inputs)
    # the CPU generator's state right after the model was built: rank 0's random stream (runtime.streams)
    built_rng_state: Optional[torch.Tensor] = None
    precision_note: str = ""  # why an exported graph keeps its fp32 casts under bf16-mixed (planner.model.casts)
    init_state_note: str = ""  # the --init-state entries the model does not name (runtime.initstate.unused_note)

    def parameters(self) -> List[nn.Parameter]:
        """This rank's parameters, each once (a tie within the rank is one parameter)."""
        seen, params = set(), []
        for stage in self.stages:
            for p in stage.module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def trainable(self) -> List[nn.Parameter]:
        """This rank's parameters that train (requires_grad), each once: what the optimizer steps,
        the gradient reductions sum and clipping counts. Frozen ones (a fine-tune's base weights)
        keep their values and never have a gradient."""
        return [p for p in self.parameters() if p.requires_grad]


def _check_units(plan: Plan, captured: CapturedModel) -> None:
    planned = [name for stage in plan.stages for name in stage.units]
    actual = captured.unit_names
    if planned != actual:
        first_difference = next((i for i, (a, b) in enumerate(zip(planned, actual)) if a != b),
                                min(len(planned), len(actual)))
        def name(names: List[str]) -> str:
            return repr(names[first_difference]) if first_difference < len(names) else "none"

        # (the same counts read "has 6 units but the plan names 6": say which names differ)
        raise PlanMismatchError(
            f"the model's graph has {len(actual)} units and the plan names {len(planned)}; unit {first_difference} "
            f"is {name(actual)} in the graph and {name(planned)} in the plan; the model changed since it was "
            "profiled (or the plan was edited): re-run `planner profile` and `planner solve`")


def _check_values(where: str, planned: List[Dict[str, Any]], actual: List[str]) -> None:
    names = [v["name"] for v in planned]
    if names != actual:
        raise PlanMismatchError(f"{where}: the plan sends {names} but the model's graph has {actual}; "
                                "re-run `planner profile` and `planner solve`")


def _segments(captured: CapturedModel, first: int, end: int, recompute: Sequence[str],
              each_unit: bool = False) -> List[Segment]:
    """Units [first, end) as segments: each recomputed unit alone, runs of others fused (with
    `each_unit`, every unit alone)."""
    names = captured.unit_names
    unknown = [u for u in recompute if u not in names[first:end]]
    if unknown:
        raise PlanMismatchError(f"the plan recomputes {unknown}, which are not units of stage [{first}, {end})")
    bounds: List[Tuple[int, int, bool]] = []
    k = first
    while k < end:
        if names[k] in recompute:
            bounds.append((k, k + 1, True))
            k += 1
        else:
            e = k
            while e < end and names[e] not in recompute and not (each_unit and e > k):
                e += 1
            bounds.append((k, e, False))
            k = e
    segments = []
    for a, e, again in bounds:
        module, io = captured.stage_module(a, e)
        segments.append(Segment(module, io, again))
    return segments


def _recast(plan: Plan, captured: CapturedModel, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> str:
    """An exported graph computing as the run's precision does (planner.model.casts), or what it could not
    take; the model is built again on meta for it, with the random state kept (every rank draws alike)."""
    model = plan.model
    left = recast_model(captured, model["entry"], model.get("args", {}), int(model.get("seed", 0)),
                        spec.batch(EXAMPLE_BATCH_SIZE, 0)[0], dtype, device)
    return f"bf16-mixed: of the captured graph, {left}; the run may differ from one bf16-mixed process " \
        f"there by bf16 rounding" if left else ""


def plan_spec(plan: Plan, on_meta: bool = False) -> ModelSpec:
    """The plan's model built from its entry point, arguments and seed; `on_meta`: its parameters on
    the meta device (no storage: runtime.initstate fills a rank's stages from a file)."""
    model = plan.model
    with parameters_on_meta() if on_meta else contextlib.nullcontext():
        return build_spec(model["entry"], model.get("args", {}), int(model.get("seed", 0)))


def build_rank(plan: Plan, topology: Topology, pipeline_rank: int, device: torch.device = torch.device("cpu"),
               init_state: Optional[InitState] = None, unit_segments: bool = False,
               autocast: Optional[torch.dtype] = None) -> RankModel:
    """This rank's stages, their nodes placed on `device` (the parameters are moved by the caller).
    With `init_state` the model is built and captured on meta and only this rank's stages get
    storage, on `device`, from the file (runtime.initstate). With `unit_segments` every stage runs
    as one segment per unit (sharded parameters are gathered per unit: runtime.shard_params).
    With `autocast` (bf16-mixed) an exported graph computes as the run's precision does
    (planner.model.casts; what it cannot take is the rank's `precision_note`)."""
    device = torch.device(device)
    if init_state is None:
        spec = plan_spec(plan)
        built_rng_state = torch.get_rng_state()
        captured = capture(spec.module)
        init_state_note = ""
    else:
        spec = plan_spec(plan, on_meta=True)
        built_rng_state = torch.get_rng_state()
        real_buffers = to_meta(spec.module)
        names = model_names(spec.module)
        init_state_note = unused_note(init_state, spec.module)
        captured = capture(spec.module, example_inputs=meta_example(spec.batch(EXAMPLE_BATCH_SIZE, 0)[0]))
    # the loss runs on the graph's output: what forward sets on the model is not there (planner.model.forward_state)
    spec = pipeline_spec(spec, captured.forward_sets)
    if device.type != "cpu" or init_state is not None:
        captured.place_nodes(device)
    # after placing: the second export's nodes name the run's device too
    precision_note = _recast(plan, captured, spec, autocast, device) if autocast is not None else ""
    _check_units(plan, captured)
    captured.check_batch_size(plan.micro_batch_size, f"plan with micro-batch size {captured.fixed_batch}")
    stages = plan.stages
    ranges = [(s.first_unit, s.end_unit) for s in stages]
    modules = [captured.stage_module(first, end)[0] for first, end in ranges]
    writers = state_writers(captured) if any(topology.replicas_of(g) > 1 for g in range(len(stages))) else set()

    # Which stages use each parameter object (a tied weight is one object under two names).
    canonical = {}
    for name, p in spec.module.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
    users: Dict[int, set] = {}
    for g, module in enumerate(modules):
        for p in module.parameters():
            users.setdefault(id(p), set()).add(g)
    # A tie: stages on different pipeline ranks use one parameter (a replicated stage's lanes are
    # not ties: they hold the same stage, and sum their gradients with the data-parallel group).
    # A frozen weight has no gradient to sum: used on several ranks, it is no tie.
    trains = {id(p): p.requires_grad for p in spec.module.parameters()}
    holders = {pid: sorted({q for g in users_of for q in topology.ranks_of(g)}) for pid, users_of in users.items()
               if len(users_of) > 1 and trains.get(pid, True)}
    tied_groups = sorted((canonical[pid], tuple(ranks)) for pid, ranks in holders.items() if len(ranks) > 1)

    # Each model state entry is saved by the first stage holding its tensor, read under the stage's
    # name for that tensor: an aliased parameter (one tensor, several names, like BERT's
    # cls.predictions.bias and cls.predictions.decoder.bias) may be used under one name only, and
    # every name must carry the trained value. Stage 0 also saves the entries no stage uses.
    held: Dict[int, Tuple[int, str]] = {}  # tensor id -> (first stage holding it, its key there)
    for g, module in enumerate(modules):
        for key, value in module.state_dict(keep_vars=True).items():
            held.setdefault(id(value), (g, key))
    sources = {key: held.get(id(value), (0, None)) for key, value in spec.module.state_dict(keep_vars=True).items()}

    mine: List[RankStage] = []
    for g in topology.stages_of(pipeline_rank):
        first, end = ranges[g]
        plan_stage = stages[g]
        recompute = list(plan_stage.recompute)
        io = captured.stage_io(first, end)
        _check_values(f"stage {g} input", plan_stage.recv, io.received)
        _check_values(f"stage {g} output", plan_stage.send, io.sent)
        if recompute or unit_segments:
            module: nn.Module = SegmentedStage(_segments(captured, first, end, recompute, unit_segments), io)
        else:
            module = modules[g]
        writing = sorted(writers & set(range(first, end))) if topology.replicas_of(g) > 1 else []
        if writing:
            names = ", ".join(repr(captured.units[k].name) for k in writing)
            raise PlanMismatchError(f"stage {g}'s unit(s) {names} write state in their forward (running statistics, "
                                    f"a running average, a counter): its {topology.replicas_of(g)} replicas would each "
                                    "write their own copy from their own micro-batches; do not replicate this stage")
        mine.append(RankStage(index=g, num_stages=len(stages), module=module, io=io,
                              recv=list(plan_stage.recv), send=list(plan_stage.send),
                              state_sources={k: source for k, (holder, source) in sources.items() if holder == g},
                            model_inputs=list(captured.placeholders), recompute=recompute))
    if init_state is not None:
        materialise([st.module for st in mine], [spec.module], names, init_state, real_buffers, device)
    held = {id(p): p for st in mine for p in st.module.parameters()}
    by_name = dict(spec.module.named_parameters(remove_duplicate=False))
    tied = {name: (by_name[name], ranks) for name, ranks in tied_groups
            if pipeline_rank in ranks and id(by_name[name]) in held}
    # Other ranks' stages were built too (the whole model is seeded and captured everywhere): keep
    # none of their tensors. Entries no stage uses stay (stage 0 saves them at their initial value).
    own = {id(t) for st in mine for t in st.module.state_dict(keep_vars=True).values()}
    used = {id(t) for module in modules for t in module.state_dict(keep_vars=True).values()}
    release([spec.module, captured.gm, *modules], used - own)
    return RankModel(spec=spec, stages=mine, tied=tied, tied_groups=tied_groups, precision_note=precision_note,
                     init_state_note=init_state_note, built_rng_state=built_rng_state,
                     input_values=captured.input_values)


def stage_state(stage: RankStage, spec: ModelSpec, init_state: Optional[InitState] = None,
                module_state: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """The model state entries this stage saves, under the model's names (every name of an aliased
    parameter), on the CPU; `module_state`: the stage module's state_dict when it is not the
    module's own (gathered from shards: runtime.shard_params)."""
    own = {}
    for key, value in (stage.module.state_dict() if module_state is None else module_state).items():
        own[key.split("parts.", 1)[-1].split(".", 1)[-1] if key.startswith("parts.") else key] = value
    full = spec.module.state_dict()  # entries no stage uses keep their initial values

    def initial(key: str) -> torch.Tensor:
        value = full[key]
        return init_state.get(key) if value.device.type == "meta" and init_state is not None else value

    return {k: (own[source] if source is not None else initial(k)).detach().cpu().clone()
            for k, source in stage.state_sources.items()}
