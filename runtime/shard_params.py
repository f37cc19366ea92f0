"""Parameters sharded across a stage's data-parallel holders (a plan's `shard: parameters`, ZeRO-3),
trained exactly as one process, by torch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each stage module of this rank is one FSDP2 unit over the rank's data-parallel group (the holders
of its stages: replicas and lanes): its parameters are kept as dim-0 shards (DTensors), one n-th
per holder. The engine calls the module per micro-batch as without sharding; FSDP2's hooks do the
rest:
- before each forward, the unit's parameters are all-gathered; after it they are freed
  (reshard_after_forward);
- before each backward (whose recomputation, runtime.stage's checkpointed segments, runs inside
  it), they are gathered again; after it they are freed and the micro-batch's gradients are
  reduce-scattered, each holder adding its shard to its sharded gradient. A unit whose backward
  does not run (`backward_runs`: nothing in it trains and nothing it reads carries a gradient, e.g.
  a frozen embedding) is not gathered for it: autograd never reaches it, and the unit after it
  prefetches it only when it runs (FSDP2's own prefetch would gather it anyway, for nothing). So a holder keeps an
  n-th of the gradients between micro-batches, as planner/cost/memory.py counts for `parameters`,
  and sends per micro-batch (n - 1)/n (2 w + g) per parameter (two gathers and one
  reduce-scatter), the traffic it charges. Why not accumulate whole gradients over the step's
  micro-batches and reduce-scatter once (FSDP's no-sync): the holder would then keep whole
  gradients, the memory of `optimizer` sharding, not of `parameters`;
- the reduction is a plain sum (gradient divide factor 1, sum collectives: gloo has no
  pre-multiplied sum): the engine's loss is already divided by d·m (runtime.engine);
- each holder's optimizer steps its shards (its optimizer state is an n-th too).

One difference from one process: a weight whose output reaches no loss gets a zero gradient where one
process leaves None (so weight decay moves it): FSDP2 passes a unit's inputs through an autograd
function for its post-backward hook, and autograd hands such a function zeros for the gradient an
input did not get.

Kept whole (not sharded, as `optimizer` and `gradients` sharding keep them): tied weights used on
several pipeline ranks (their gradients are summed over every holder by runtime.groups, in every
replica) and a parameter two stages of this rank share (its gradient is all-reduced over the
data-parallel group here before the step). Frozen parameters are sharded and gathered like the
others; they have no gradient to reduce.

Refused in one line (`refusal`): replicated stages (a stage's lanes run different micro-batches,
so their gathers and reduce-scatters would not pair up), bf16-mixed (planner.model.precision's one compute copy per step would
replace the parameters FSDP2 gathers; FSDP2's own mixed precision casts per gather, another
rounding order than the single-process reference), zero-bubble schedules (their split backward
reaches the weights after FSDP2 has freed them), gradient clipping (each holder has an n-th of
the gradients) and checkpoints (the shards are DTensors this runtime's checkpoint files do not
hold).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Set

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from planner.cost.memory import shard_parameters_refusal
from planner.profile.saved import is_sharded, local_tensor
from runtime.groups import sum_gradient


def refusal(precision: str, schedule: str, replicated: bool, clipping: bool, checkpointing: bool) -> Optional[str]:
    """Why a `shard: parameters` run with these options is not run (one line: cause and fix), or None."""
    fix = "; re-plan with `planner solve --shard gradients`"
    refused = shard_parameters_refusal(precision, schedule, replicated)  # the plan's own (planner.plan.runnable)
    if refused:
        return refused
    if clipping:
        # gradients sharded refuse clipping too (runtime.shard): the optimizer state alone is the fix
        return ("--clip-grad-norm with a plan sharding parameters is not supported (drop the clipping; re-plan "
                "with `planner solve --shard optimizer`)")
    if checkpointing:
        return f"--checkpoint-dir with a plan sharding parameters is not supported (drop it{fix})"
    return None


def backward_runs(stage: Any) -> List[bool]:
    """Per unit segment of a RankStage (runtime.stage): whether its backward runs -- it holds a
    trainable parameter, or reads a value carrying a gradient (one the stage receives with a gradient,
    or one a unit whose backward runs produced). The rule planner.cost.ranges charges gathers by."""
    carrying = {name for name, value in zip(stage.io.received, stage.recv) if value.get("requires_grad")}
    runs = []
    for segment in stage.module.segments:
        reads = segment.io.inputs + segment.io.received
        here = any(p.requires_grad for p in segment.module.parameters()) or any(n in carrying for n in reads)
        if here:
            carrying.update(segment.io.sent)
        runs.append(here)
    return runs


def _prefetch_where_backward_runs(stage: Any) -> None:
    """Each unit's backward prefetches the unit before it only if that one's backward runs. An
    explicit list replaces FSDP2's implicit prefetch of the previous unit forwarded, which gathers
    a unit autograd never reaches; a unit that should prefetch nothing lists itself (gathered
    already when the list is read: no collective)."""
    segments = getattr(stage.module, "segments", [])
    if not segments:
        return
    runs = backward_runs(stage)
    for k, segment in enumerate(segments):
        previous = segments[k - 1].module if k > 0 and runs[k - 1] else segment.module
        segment.module.set_modules_to_backward_prefetch([previous])


def _refuse_parameter_views(whole_names: Set[str], module: nn.Module, args: Any, output: Any) -> None:
    """Refuse (ValueError, one line) a unit whose output shares storage with one of its sharded
    parameters (`self.latents.expand(batch, -1, -1)`, a parameter returned as it is): FSDP2 frees the
    gathered parameters when the unit's forward ends, so the units after it would read freed memory
    (the rank died of SIGSEGV, or read garbage). Runs as a forward hook before FSDP2's own."""
    gathered = {p.untyped_storage().data_ptr(): name for name, p in module.named_parameters()
                if name not in whole_names and p.untyped_storage().data_ptr()}
    for value in tree_leaves(output):
        name = gathered.get(value.untyped_storage().data_ptr()) if isinstance(value, torch.Tensor) else None
        if name is not None:
            raise ValueError(
                f"a unit passes on a view of its own parameter {name!r} (shape {tuple(value.shape)}), which "
                "`shard: parameters` (FSDP2) frees when the unit's forward ends, before the units after it read "
                "it; fix: re-plan with `planner solve --shard gradients` (or optimizer), or copy it in the model's "
                "forward (`.clone()`, or `.contiguous()` after `expand`)")


class ParameterSharding:
    """This rank's stage modules sharded over `group` (module docstring), and their optimizer:
    `optimizer_for` gives what runtime.worker steps."""

    reduces_gradients = True  # the engine skips its data-parallel buckets: FSDP2 reduce-scatters

    def __init__(self, stages: List[Any], tied: List[nn.Parameter], group: Any, device: torch.device):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        self.group = group
        modules = [stage.module for stage in stages]
        self.modules = modules
        # one FSDP2 unit per plan unit (runtime.stage's unit segments), then the stage around them
        self.units = [seg.module for m in modules for seg in getattr(m, "segments", [])]
        uses: Dict[int, int] = {}
        for unit in self.units or modules:
            for p in unit.parameters():
                uses[id(p)] = uses.get(id(p), 0) + 1
        tied_ids = {id(p) for p in tied}
        # read by two units here (not a tie across ranks): all-reduced over the group in `step`
        self.shared_here = list({id(p): p for m in modules for p in m.parameters()
                                 if uses[id(p)] > 1 and id(p) not in tied_ids}.values())
        whole = tied_ids | {id(p) for p in self.shared_here}
        mesh = DeviceMesh.from_group(group, device.type)
        kept = [{name for name, p in module.named_parameters() if id(p) in whole} for module in self.units or modules]
        for module in self.units + modules:  # bottom-up, as fully_shard requires
            fully_shard(module, mesh=mesh, reshard_after_forward=True,
                        ignored_params={p for p in module.parameters() if id(p) in whole} or None)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        for module, whole_names in zip(self.units or modules, kept):
            # before FSDP2's post-forward hook (which frees the gathered parameters): prepended
            module.register_forward_hook(functools.partial(_refuse_parameter_views, whole_names), prepend=True)
        for stage in stages:
            _prefetch_where_backward_runs(stage)
        self.local: Any = None

    def parameters(self) -> List[nn.Parameter]:
        """This rank's parameters as held between steps (shards, and whole kept ones), each once."""
        return list({id(p): p for m in self.modules for p in m.parameters()}.values())

    def optimizer_for(self, make: Any) -> "ParameterSharding":
        """`make(params)` builds the optimizer of this rank's trainable shards; this object steps it."""
        self.local = make([p for p in self.parameters() if p.requires_grad])
        return self

    # --- what runtime.worker and runtime.engine call on an optimizer (set_lr sets `local`'s rate) ---
    def step(self) -> None:
        for p in self.shared_here:
            if p.requires_grad:
                sum_gradient(p, self.group)
        self.local.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.local.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self.local.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.local.load_state_dict(state)

    # --- state and measurements --------------------------------------------------------------------
    def full_states(self) -> List[Dict[str, torch.Tensor]]:
        """Each stage module's state_dict with whole tensors: a collective, every holder calls it."""
        return [{key: (value.full_tensor() if is_sharded(value) else value).detach()
                 for key, value in module.state_dict().items()} for module in self.modules]

    def resident_param_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now: the shards and whole kept parameters, and
        any gathered parameters not freed (none between steps)."""
        storages: Dict[int, int] = {}
        for p in self.parameters():
            local = local_tensor(p)
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        for module in self.units + self.modules:
            # FSDP2's own record of the gathered parameters (private: read defensively)
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", []):
                gathered = getattr(fsdp_param, "_unsharded_param", None)
                if gathered is not None and gathered.untyped_storage().nbytes() > 0:
                    storages[gathered.untyped_storage().data_ptr()] = gathered.untyped_storage().nbytes()
        return sum(storages.values())

    def exclude_gathered(self, saved: Any, counting: Callable[[], bool]) -> None:
        """Have runtime's SavedBytes count the gathered parameters as parameters, not as saved
        activations: each forward gathers them anew (new storage), so the exclusion is set then --
        while `counting()` (the engine counts saved bytes in its first step only)."""
        for module in self.units or self.modules:
            # FSDP2's pre-forward hook is prepended: this one runs after it, on the gathered parameters
            module.register_forward_pre_hook(lambda m, args: saved.exclude(m.parameters()) if counting() else None)
