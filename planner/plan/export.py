"""A plan as the configuration of engines people already run: torchtitan's job config and a
torch.distributed.pipelining script (`planner export PLAN --format torchtitan|torch`).

torchtitan (its `[parallelism]` / `[training]` job-config sections, as in torchtitan's
`torchtitan/config/job_config.py`): `pipeline_parallel_degree` (p), `module_fqns_per_model_part`
(one list of module names per stage, in stage order: this plan's units, which are the model's
module paths), `pipeline_parallel_schedule` (torch's schedule name), `pipeline_parallel_microbatch_size`
(b), `data_parallel_replicate_degree` (d, plain replicas: the plan shards nothing) and
`local_batch_size` (per data-parallel replica, G / d: torchtitan runs local_batch_size / b
micro-batches). Newer torchtitan releases rename some keys (`pipeline_parallel_module_fqns_per_model_part`,
`num_pp_microbatches`); the output says which release's names it uses.

What neither can express is refused in one line: a layout torch.distributed.pipelining cannot run
(`torch_layout_refusal`, which `runtime execute --engine torch` checks too: replicated stages, a
placement other than stage g on rank g mod p, placed replicas, sharding, local SGD) and
recomputation of chosen units (torchtitan applies activation checkpointing per layer by its own rules).
"""
from __future__ import annotations

import json
from typing import List, Optional, Tuple

from planner.pipeline.schedule import stage_placement
from planner.plan.file import Plan

FORMATS = ("torchtitan", "torch")
TORCH_SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "bfs": "LoopedBFS"}


def torch_layout_refusal(plan: Plan) -> Optional[Tuple[str, str]]:
    """What of the plan's layout torch.distributed.pipelining (and so torchtitan) cannot express, as
    (cause: a noun phrase after "a plan with", the re-planning that removes it), or None. Its layout,
    the one definition the export and `runtime execute --engine torch` both check: one stage per
    device; stage g on pipeline rank g mod p (the V for zb-v); replica r's pipeline rank i on rank
    r p + i; every replica holding whole state (no sharding) and averaging every step (no local SGD); under 1F1B
    at least as many micro-batches as stages."""
    topology = plan.topology()
    if topology.replicated:
        return ("replicated stages (a stage on several devices; torch's stages are one per device)",
                "re-plan without --replicate")
    if tuple(topology.stage_rank) != stage_placement(plan.schedule, len(topology.stage_rank), plan.virtual_stages):
        return ("stage g placed elsewhere than on pipeline rank g mod p (torch's loop placement; the V for zb-v)",
                "re-plan with the default placement")
    if topology.placement is not None:
        return ("its replicas' ranks placed on chosen devices (--topology; torch orders its groups by rank, replica "
                "r's pipeline rank i as rank r p + i)", "re-plan without --topology")
    if plan.shard != "none":
        return (f"--shard {plan.shard} (torch's stages and this export shard nothing)", "re-plan with --shard none")
    if plan.sync_every > 1:
        return (f"local SGD (its replicas average their models every {plan.sync_every} steps)",
                "re-plan with --local-sgd-max 1")
    m, p = plan.num_micro_batches, topology.pipeline_ranks
    if plan.schedule == "1f1b" and m < p:  # Schedule1F1B raises it when built, on every rank
        return (f"{m} micro-batch(es) a step on {p} pipeline ranks under 1F1B (torch's Schedule1F1B needs at least "
                "as many micro-batches as stages)", f"re-plan with a global batch that gives at least {p}")
    return None


def export_refusal(plan: Plan) -> Optional[str]:
    """Why this plan cannot be exported (one line, cause and fix), or None."""
    if plan.schedule not in TORCH_SCHEDULE_NAMES:
        return (f"the plan's schedule {plan.schedule} has no torch/torchtitan name this export can give (torch's "
                f"zero-bubble schedules order their work otherwise); exportable: {', '.join(TORCH_SCHEDULE_NAMES)}; "
                "re-plan with one of them")
    layout = torch_layout_refusal(plan)
    if layout:
        cause, fix = layout
        return f"the export cannot write a plan with {cause}; {fix}"
    if any(st.recompute for st in plan.stages):
        return ("the plan recomputes chosen units, which the export cannot express (torchtitan checkpoints whole "
                "layers by its own rules); re-plan without recomputation")
    return None


def module_names_per_stage(plan: Plan) -> List[List[str]]:
    return [list(st.units) for st in plan.stages]


def torchtitan_config(plan: Plan, source: str) -> str:
    """The TOML torchtitan's job config needs to run the plan's pipeline."""
    p = plan.topology().pipeline_ranks
    names = module_names_per_stage(plan)
    parts = ",\n".join("    " + json.dumps(stage) for stage in names)
    return "\n".join([
        f"# torchtitan job-config sections reproducing {source}: model {plan.model.get('entry')},",
        f"# {len(names)} stages on {p} pipeline ranks x {plan.data_parallel} data-parallel replicas, "
        f"predicted step {plan.predicted_iteration_s * 1e3:.2f} ms.",
        "# Key names of torchtitan's job_config.py (TOML configs); newer releases call the split",
        "# pipeline_parallel_module_fqns_per_model_part and count num_pp_microbatches (= local_batch_size / microbatch size).",
        "# The module names are this model's module paths (the plan's units), one list per stage.",
        "[parallelism]",
        f"pipeline_parallel_degree = {p}",
        f'pipeline_parallel_schedule = "{TORCH_SCHEDULE_NAMES[plan.schedule]}"',
        f"pipeline_parallel_microbatch_size = {plan.micro_batch_size}",
        f"data_parallel_replicate_degree = {plan.data_parallel}",
        "data_parallel_shard_degree = 1",
        "tensor_parallel_degree = 1",
        f"module_fqns_per_model_part = [\n{parts},\n]",
        "",
        "[training]",
        f"local_batch_size = {plan.global_batch // plan.data_parallel}",
        f"global_batch_size = {plan.global_batch}",
        "",
    ])


_SNIPPET = '''"""{source} with torch.distributed.pipelining: {stages} stages on {p} ranks, schedule {schedule_name},
{m} micro-batches of {b} (global batch {g}{dp}). Written by `planner export --format torch`.

    torchrun --nproc-per-node {p} this_file.py

Each rank builds the model (same seed everywhere), keeps the modules of its stages (each stage is
an nn.Module that calls them; write its forward for your model: see `StagePart`), and runs torch's
schedule. For an exact copy of the plan's stages (fx graphs, skips passed through, any model), use
`runtime execute PLAN --engine torch` instead.
"""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, {schedule_class}

MODULES_PER_STAGE = {modules}
NUM_STAGES, NUM_MICRO_BATCHES, MICRO_BATCH_SIZE = {stages}, {m}, {b}


class StagePart(nn.Module):
    """The named modules of one stage, called in order (a chain: each takes the previous output).
    A model whose units are not a chain (skips, several inputs) needs its own forward here."""

    def __init__(self, model: nn.Module, names):
        super().__init__()
        self.names = list(names)
        self.parts = nn.ModuleList(model.get_submodule(n) for n in self.names)

    def forward(self, x):
        for part in self.parts:
            x = part(x)
        return x


def build(model: nn.Module, loss_fn, device: torch.device):
    """This rank's stages and torch's schedule for them (stage g on rank g mod {p})."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pipeline = {p}
    stages = [PipelineStage(StagePart(model, MODULES_PER_STAGE[g]).to(device), g, NUM_STAGES, device)
              for g in range(rank % pipeline, NUM_STAGES, pipeline)]
    schedule = {schedule_class}({stage_arg}, n_microbatches=NUM_MICRO_BATCHES, loss_fn=loss_fn)
    return stages, schedule


if __name__ == "__main__":
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed({seed})
    model = ...  # build {entry} here{args}
    loss_fn = ...  # the mean loss of one micro-batch: loss_fn(output, target)
    stages, schedule = build(model, loss_fn, device)
    # per step: schedule.step(inputs) on the first stage's rank, schedule.step(target=target, losses=[])
    # on the last stage's, schedule.step() elsewhere; then optimizer.step() over the stages' parameters
    dist.destroy_process_group()
'''


def torch_snippet(plan: Plan, source: str) -> str:
    """A short Python script building the plan's stages with torch.distributed.pipelining."""
    p = plan.topology().pipeline_ranks
    names = module_names_per_stage(plan)
    modules = "[\n" + "".join(f"    {json.dumps(stage)},\n" for stage in names) + "]"
    schedule_class = "Schedule" + TORCH_SCHEDULE_NAMES[plan.schedule]
    single = plan.schedule in ("gpipe", "1f1b")
    args = plan.model.get("args") or {}
    return _SNIPPET.format(
        source=source, stages=len(names), p=p, schedule_name=TORCH_SCHEDULE_NAMES[plan.schedule],
        m=plan.num_micro_batches, b=plan.micro_batch_size, g=plan.global_batch,
        dp=f", {plan.data_parallel} data-parallel replicas: add them yourself" if plan.data_parallel > 1 else "",
        schedule_class=schedule_class, modules=modules, stage_arg="stages[0]" if single else "stages",
        seed=int(plan.model.get("seed", 0)), entry=plan.model.get("entry"),
        args=f" with {json.dumps(args)}" if args else "")
