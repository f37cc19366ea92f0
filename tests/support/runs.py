"""Helpers for runtime tests: profiles, plans with chosen cuts, runs, and single-process references."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

import torch

from planner.model.entry import build_spec
from planner.model.spec import call_model
from planner.plan.file import Plan, save_plan
from planner.profile.subnormal import flushed
from planner.plan.make import plan_for_split
from planner.profile.measure import profile_model
from planner.profile.profile import Profile
from runtime.microbatch import split_micro_batches

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


@functools.lru_cache(maxsize=None)
def _profile(entry: str, args_json: str, sizes: tuple, precision: str = "fp32") -> Profile:
    return profile_model(entry, json.loads(args_json), list(sizes), repeats=1, precision=precision)


def profile_of(entry: str, args: Optional[dict] = None, sizes: Sequence[int] = (1, 2, 4),
               precision: str = "fp32") -> Profile:
    """The model's profile (cached); `precision` "bf16-mixed": measured as such a run (planner profile --precision)."""
    return _profile(entry, json.dumps(args or {}, sort_keys=True), tuple(sizes), precision)  # (lists as lists)


def plan_with(profile: Profile, boundaries: List[int], micro_batch_size: int, global_batch: int,
              schedule: str = "1f1b") -> Plan:
    """A plan with the given cuts (not solved): for testing the runtime on chosen splits."""
    return plan_for_split(profile, boundaries, micro_batch_size, global_batch, schedule, "test")


def fixed_plan(profile: Profile, cuts: List[int], schedule: str, recompute: List[int], b: int = 2,
               global_batch: int = 8, precision: Optional[str] = None, virtual_stages: int = 1) -> Plan:
    """The plan of one split and recomputation (not solved); `virtual_stages` stages per rank (zb-v: 2)."""
    from planner.cost.model import evaluate
    from planner.cost.options import CostOptions
    from planner.plan.make import make_plan
    from planner.solve.solution import Solution

    opts = CostOptions(pipeline_ranks=(len(cuts) + 1) // virtual_stages, virtual_stages=virtual_stages,
                       global_batch=global_batch, schedule=schedule, recompute="auto", precision=precision)
    cost = evaluate(profile, cuts, b, opts, recompute)
    solution = Solution(boundaries=cuts, micro_batch_size=b, num_micro_batches=global_batch // b, cost=cost,
                        status="fixed", objective=cost.iteration_s, bound=cost.iteration_s, gap=0.0, seconds=0.0,
                        method="fixed", backend="none")
    return make_plan(profile, solution, opts, "")


def held_and_planned(tmp_path, entry: str, args: dict, cuts: List[int], schedule: str, recompute: List[int]) -> list:
    """(bytes a rank held, bytes the plan says) per rank of one step of a fixed plan, its parameters checked
    against one process's (1e-5)."""
    profile = profile_of(entry, args, sizes=(2,))
    plan = fixed_plan(profile, cuts, schedule, recompute, virtual_stages=2 if schedule == "zb-v" else 1)
    state = execute(plan, tmp_path, steps=1)
    assert max_abs_diff(state, reference_state(plan, steps=1)) <= 1e-5
    return [(rank["peak_saved_bytes"], rank["predicted_activation_bytes"]) for rank in report_of(tmp_path)["stages"]]


def run_cli(args: Sequence[str], timeout: float = 240, env: Optional[Dict[str, str]] = None
            ) -> subprocess.CompletedProcess:
    """Run `python -m <args>` from the repository root, capturing output (env: variables to add)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_here(args: Sequence[str]) -> subprocess.CompletedProcess:
    """`run_cli` in this process (no second torch import: 2 s of a 2-core CI machine a call), for a
    test of what the command does, not of its process: args[0] is "planner.cli" or "runtime.cli"
    (ranks then start from this process's fork server). Entry points, and what a command's process
    does on its way out, are tested through `run_cli`."""
    import importlib

    main = importlib.import_module("planner.cli.main" if args[0] == "planner.cli" else args[0]).main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args[1:]))
        except SystemExit as stop:  # argparse's refusals
            code = stop.code if isinstance(stop.code, int) else 1
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def execute(plan: Plan, tmp_path, steps: int = 3, lr: float = 0.05, extra: Sequence[str] = ()) -> Dict[str, torch.Tensor]:
    """Write the plan, run `runtime execute` on it, return the saved full state_dict (the report
    is left in tmp_path/report.json, what the command printed in tmp_path/execute.out)."""
    from runtime.cli import main as runtime_main

    os.makedirs(str(tmp_path), exist_ok=True)
    plan_path = os.path.join(str(tmp_path), "plan.json")
    state_path = os.path.join(str(tmp_path), "state.pt")
    save_plan(plan, plan_path)
    # In this process, not as `python -m runtime.cli`: the command's own process would import torch
    # again (2 s of a 2-core CI machine per run) to merge the ranks' states. The ranks are real
    # processes either way; tests/cli/test_cli.py runs the command itself.
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = runtime_main(["execute", plan_path, "--steps", str(steps), "--lr", str(lr), "--save-state", state_path,
                             "--report", os.path.join(str(tmp_path), "report.json"), *extra])
    assert code == 0, out.getvalue() + err.getvalue()
    with open(os.path.join(str(tmp_path), "execute.out"), "w") as f:
        f.write(out.getvalue())
    return torch.load(state_path, weights_only=True)


def reshape_plan(plan: Plan, virtual_stages: int = 1, data_parallel: int = 1, schedule: Optional[str] = None,
                 recompute: Optional[Dict[int, List[str]]] = None, replicas: Optional[List[int]] = None) -> Plan:
    """Turn a plan of P stages into one with P / v pipeline ranks of v stages each (looping
    placement), d replicas (global batch scaled by d), recomputed units and stage replicas
    (r_g devices for stage g, consecutive): the fields the runtime reads, set the way
    `planner solve` sets them."""
    num_stages = len(plan.stages)
    p = num_stages // virtual_stages
    replicas = list(replicas or [1] * num_stages)
    devices = [g % p for g in range(num_stages)] if virtual_stages > 1 else [sum(replicas[:g]) for g in range(num_stages)]
    stages = [dataclasses.replace(s, device=devices[g], replicas=replicas[g],
                                  recompute=list((recompute or {}).get(g, []))) for g, s in enumerate(plan.stages)]
    p = p if virtual_stages > 1 else sum(replicas)
    # the collectives' members were the stages' ranks (one each): now the ranks running those stages
    ranks_of = [[devices[g]] if virtual_stages > 1 else list(range(devices[g], devices[g] + replicas[g]))
                for g in range(num_stages)]
    durations = dict(plan.step_durations)
    durations["collectives"] = [dict(c, ranks=sorted({r for g in c["ranks"] for r in ranks_of[g]}))
                                for c in plan.step_durations.get("collectives", [])]
    return dataclasses.replace(plan, stages=stages, virtual_stages=virtual_stages, pipeline_stages=p,
                               step_durations=durations,
                               data_parallel=data_parallel, schedule=schedule or plan.schedule,
                               global_batch=plan.micro_batch_size * plan.num_micro_batches * data_parallel)


def reference_state(plan: Plan, *args, **kwargs) -> Dict[str, torch.Tensor]:
    """`_reference_state` computing as the plan's ranks do: subnormal floats flushed where the profile
    was timed so (planner.profile.subnormal)."""
    with flushed(plan.flush_subnormals):
        return _reference_state(plan, *args, **kwargs)


def _reference_state(plan: Plan, steps: int = 3, lr: float = 0.05, optimizer: str = "sgd",
                    losses: Optional[List[float]] = None, first_step: int = 0,
                    buffers_of_replica: Optional[int] = None, init_state: Optional[str] = None,
                    training: Optional[Dict[str, object]] = None,
                    replica_streams: bool = False) -> Dict[str, torch.Tensor]:
    """Single-process training on the same micro-batches: the ground truth, parameters and buffers.
    All d·m micro-batches of a step (the replicas' slices in order) contribute loss / (d·m) to one
    accumulated gradient. With `buffers_of_replica` = r, only replica r's micro-batches update the
    buffers (running statistics), as the ranks of data-parallel replica r keep them. With
    `replica_streams` (one pipeline rank) replica r's micro-batches draw their random numbers from
    its rank's stream (runtime.streams), as a data-parallel run does."""
    torch.set_num_threads(1)
    model = plan.model
    spec = build_spec(model["entry"], model.get("args", {}), int(model.get("seed", 0)))
    if init_state is not None:  # a state_dict file (torch.save)
        spec.module.load_state_dict(torch.load(init_state, weights_only=True))
    params = list(spec.module.parameters())
    # `training`: runtime.options.TrainOptions fields (momentum, weight_decay, betas, schedule,
    # warmup_steps, min_lr, clip_grad_norm, precision), applied with torch's own tools
    from runtime.options import TrainOptions
    from runtime.training import lr_at

    options = TrainOptions(optimizer=optimizer, lr=lr, total_steps=steps, **(training or {}))
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=options.momentum, weight_decay=options.decay)
    elif optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr, betas=options.betas, weight_decay=options.decay)
    else:
        opt = torch.optim.AdamW(params, lr=lr, betas=options.betas, weight_decay=options.decay)
    autocast = (torch.autocast("cpu", dtype=options.autocast_dtype) if options.autocast_dtype is not None
                else contextlib.nullcontext())
    # bf16-mixed: the step's one bf16 copy of the weights, fp32 masters and gradients (planner.model.precision)
    from planner.model.precision import ComputeCopy

    copy = ComputeCopy([spec.module], options.autocast_dtype) if options.autocast_dtype is not None else None
    g, b = plan.global_batch, plan.micro_batch_size
    m = g // b
    streams = {0: torch.get_rng_state()}  # replica -> its generator's state (replica_streams)
    if replica_streams:
        from runtime.streams import start_stream

        topology = plan.topology()
        assert topology.pipeline_ranks == 1, "replica_streams: one pipeline rank"
        for r in range(1, plan.data_parallel):
            start_stream(int(model.get("seed", 0)), topology.global_rank(r, 0), streams[0])
            streams[r] = torch.get_rng_state()
        torch.set_rng_state(streams[0])
    for step in range(steps):
        inputs, target = spec.batch(g, step)
        micro_inputs = split_micro_batches(tuple(inputs), g, m, "inputs")
        micro_targets = split_micro_batches(target, g, m, "target")
        total = 0.0
        per_replica = m // plan.data_parallel
        if copy is not None:
            copy.install()
        for i in range(m):
            other = buffers_of_replica is not None and i // per_replica != buffers_of_replica
            kept = [(t, t.detach().clone()) for t in spec.module.buffers()] if other else []
            if replica_streams:
                torch.set_rng_state(streams[i // per_replica])
            with autocast:
                loss = spec.loss(call_model(spec.module, micro_inputs[i]), micro_targets[i]) / m
            loss.backward()
            if replica_streams:
                streams[i // per_replica] = torch.get_rng_state()
            total += float(loss.detach()) * m
            with torch.no_grad():
                for t, value in kept:  # another replica's micro-batch: its ranks' buffers, not these
                    t.copy_(value)
        if copy is not None:
            copy.remove()
        if losses is not None:
            losses.append(total / m)
        if options.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, options.clip_grad_norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(options, first_step + step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in spec.module.state_dict().items()}


def max_abs_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """The largest difference over every entry of two state_dicts: parameters and (persistent)
    buffers, such as BatchNorm's running statistics and batch counts; both must hold the same keys."""
    assert set(a) == set(b), f"state keys differ: {sorted(set(a) ^ set(b))}"
    # NaN anywhere is an infinite difference (Python's max would drop a NaN that comes after a number)
    diffs = [(a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0 for k in a]
    return math.inf if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)


def assert_trains_like_one_process(plan: Plan, tmp_path, entry: str, args: Optional[dict] = None,
                                   steps: int = 3) -> Dict[str, torch.Tensor]:
    """Run the plan; its final state equals single-process training on the same micro-batches
    (1e-5), and training moved the weights (a runtime that skipped the update would not)."""
    state = execute(plan, tmp_path, steps=steps)
    assert max_abs_diff(state, reference_state(plan, steps=steps)) <= 1e-5
    initial = build_spec(entry, args or {}, 0).module.state_dict()
    assert max_abs_diff(state, {k: v.clone() for k, v in initial.items()}) > 1e-4
    return state


def report_of(tmp_path) -> dict:
    with open(os.path.join(str(tmp_path), "report.json")) as f:
        return json.load(f)


def run_stages(captured, inputs, cuts):
    """Run the model stage by stage in one process, as the runtime would split it."""
    values = dict(zip(captured.placeholders, captured.input_values(inputs)))
    bounds = [0, *cuts, len(captured.units)]
    for first, end in zip(bounds, bounds[1:]):
        stage, io = captured.stage_module(first, end)
        result = stage(*[values[n] for n in io.inputs + io.received])
        if io.is_last:
            return result
        values.update(zip(io.sent, result))


def _children() -> Dict[int, List[int]]:
    """{pid: its live children's pids}, from /proc's parent links."""
    children: Dict[int, List[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    return children


def descendants(pid: int, children: Optional[Dict[int, List[int]]] = None) -> List[int]:
    """The pids of every live process below `pid`."""
    children = _children() if children is None else children
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def ranks_left() -> List[int]:
    """Processes alive below this process's children: the ranks an in-process `runtime execute`
    started from its fork server (a child of this process), which must all have ended."""
    children = _children()
    return [pid for child in children.get(os.getpid(), []) for pid in descendants(child, children)]
