"""`runtime execute PLAN` and `runtime show PLAN`."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Optional

from planner.errors import OneLineParser, UsageError, run_subcommand
from planner.jsonio import JsonFileError, atomic_path, check_writable, image_format, read_json, write_json_atomic
from planner.pipeline import schedule as sched
from planner.pipeline.check import check_schedule
from planner.plan.fields import REMAKE
from planner.plan.file import Plan, load_plan
from runtime.options import ENGINES, OPTIMIZERS, P2P, P2P_HELP, RANK_TIMEOUT_S, add_training_options, forwarded

def check_plan(plan: Plan) -> List[List[sched.Action]]:
    """Everything that can be checked before starting a process (the file itself was checked when
    it was loaded): the instruction lists are complete and cannot deadlock."""
    lists = plan.instruction_lists()
    check_schedule(lists, plan.num_micro_batches, placement=plan.topology().rank_running)
    return lists


def _entry_problem(entry: Any) -> Optional[str]:
    """What keeps every rank from building the plan's model, found without importing it (the launcher stays
    quick to start; whether a module imports, the ranks say): no model (a profile imported from another tool),
    an entry of no known form, a built-in that does not exist."""
    from planner.model.builtin import entry_form_problem

    if entry is None or entry.startswith("pipedream:"):  # planner.profile.pipedream: measured elsewhere
        return (f"the plan has no model to build (model entry {entry!r}: a profile imported from another tool): it can "
                "be shown, simulated and exported, not run; profile the model with `planner profile MODEL` and "
                "solve that profile to run it")
    problem = entry_form_problem(entry)
    return f"the plan's {problem}; {REMAKE}" if problem else None


def _merge_states(out_dir: str, ranks: List[int]) -> Dict[str, Any]:
    """The whole model's state_dict from the ranks' files."""
    import torch

    state: Dict[str, Any] = {}
    for rank in ranks:
        state.update(torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=True))
    return state


def _warn_conditions(plan: Plan, threads: int, world: int) -> None:
    """Predictions hold for the conditions the profile was measured under: say when a run differs.
    (Without importing torch here: the launcher stays quick to start.)"""
    from importlib.metadata import PackageNotFoundError, version

    profiled = plan.profile
    notes = []
    if profiled.get("threads") and int(profiled["threads"]) != threads:
        notes.append(f"{threads} thread(s) per rank, profiled with {profiled['threads']}")
    try:
        installed = version("torch")
    except PackageNotFoundError:
        installed = None
    if installed and profiled.get("torch_version") and profiled["torch_version"].split("+")[0] != installed.split("+")[0]:
        notes.append(f"torch {installed}, profiled with {profiled['torch_version']}")
    if profiled.get("device") == "cuda":
        import torch

        if not torch.cuda.is_available():
            notes.append("running on CPU, profiled on CUDA")
    if profiled.get("device") == "cpu" and (os.cpu_count() or 1) < world * threads:
        notes.append(f"{world} ranks x {threads} thread(s) on {os.cpu_count()} cores")
    if notes:
        print("warning: the run differs from the profile's conditions (" + "; ".join(notes) +
              "): measured times will not match the prediction", file=sys.stderr)


def execute(args: argparse.Namespace) -> int:
    """`runtime execute`: check the plan, start one process per rank here, report what they measured."""
    from runtime.launch import launch_local
    from runtime.report import build_report, format_report

    plan = load_plan(args.plan)
    problem = _entry_problem(plan.model.get("entry"))
    if problem:
        raise UsageError(problem)
    lists = check_plan(plan)
    _check_run_options(args, plan)
    if args.engine == "torch":
        from runtime.torch_engine import refusal as torch_refusal

        refusal = torch_refusal(plan, args.precision)
        if refusal:
            raise UsageError(refusal)
    topology = plan.topology()
    threads = args.threads or int(plan.profile.get("threads", 1) or 1)
    optimizer = args.optimizer or plan.optimizer
    _warn_conditions(plan, threads, topology.world_size)
    if (optimizer == "sgd") != (plan.optimizer == "sgd"):  # Adam and AdamW hold the same state
        print(f"warning: the plan's memory model assumed {plan.optimizer}, this run uses {optimizer}",
              file=sys.stderr)
    print(f"running {args.plan}: {_shape(topology)}, {plan.schedule}, micro-batch {plan.micro_batch_size} x "
          f"{plan.num_micro_batches}, {args.steps} steps, {threads} thread(s) per rank, {optimizer}"
          + (", torch.distributed.pipelining" if args.engine == "torch" else ""), flush=True)
    if args.engine == "torch":
        _say_pass_through(plan)
    if plan.sync_every > 1:
        from runtime.localsgd import end_note

        print(f"local SGD: each replica trains alone and the replicas average their models every {plan.sync_every} "
              "steps", flush=True)
        if end_note(plan.sync_every, args.steps):
            print(end_note(plan.sync_every, args.steps), file=sys.stderr)
    if plan.emulated_boundaries:
        print(f"emulating the cluster's slow link at stage boundaries {plan.emulated_boundaries}: each message "
              "crossing it is held for its planned transfer time (runtime/emulation.py)", flush=True)
    if plan.emulated_exchange_s:
        print("emulating the slow link in the gradient exchange: each pipeline rank holds "
              f"{', '.join(f'{1e3 * s:.1f}' for s in plan.emulated_exchange_s)} ms after it", flush=True)
    if topology.placement is not None:
        print("placement: " + "; ".join(f"replica {r} on ranks {' '.join(map(str, row))}"
                                        for r, row in enumerate(topology.placement)), flush=True)
    out_dir = tempfile.mkdtemp(prefix="runtime-")
    reporter = topology.global_rank(0, topology.reporting_rank())
    result = launch_local(topology.world_size, _worker_args(args, out_dir, threads, optimizer), out_dir, threads,
                          args.timeout, progress_rank=reporter)
    if not result.ok:
        print(f"error: rank {result.failed_rank} failed: {result.error} (its log: {result.log_path}; all ranks "
              "were stopped)", file=sys.stderr)
        return 1
    ranks = [read_json(os.path.join(out_dir, f"rank{r}.json")) for r in range(topology.world_size)]
    report = build_report(plan, ranks)
    print(format_report(report))
    _write_outputs(args, plan, lists, out_dir, report)
    shutil.rmtree(out_dir, ignore_errors=True)
    return 0


def _say_pass_through(plan: Plan) -> None:
    """torch's stages pass values to the next stage only: name the bytes skips add to messages."""
    from runtime.torch_engine import pass_through_bytes

    passed = pass_through_bytes(plan)
    if any(passed):
        print("values skipping stages are passed through them (as the own engine's messages carry them): "
              + ", ".join(f"stage {g} {n / 2**10:.1f} KiB" for g, n in enumerate(passed) if n)
              + " per micro-batch", flush=True)


def _check_run_options(args: argparse.Namespace, plan: Plan) -> None:
    if not 1 <= args.steps <= 2 ** 31:  # (checkpoints count steps in a torch int64; a run this long is a typo)
        raise UsageError(f"--steps must be 1..{2 ** 31} (got {args.steps})")
    if args.checkpoint_every < 0:
        raise UsageError("--checkpoint-every K is steps, K >= 1 (0, the default: none written, --resume only reads)")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise UsageError("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_dir and not args.checkpoint_every and not args.resume:  # (it wrote nothing, and said nothing)
        raise UsageError(f"--checkpoint-dir {args.checkpoint_dir!r} alone writes no checkpoint: add --checkpoint-every K "
                         "to save one every K steps, or --resume to continue from the last one there")
    if not 1.0 <= args.timeout <= 7 * 24 * 3600:  # (below a second a rank cannot even connect to the others)
        raise UsageError("--timeout is seconds a rank may wait for another, at least 1 and at most a week")
    if args.threads < 0 or args.threads > (os.cpu_count() or 1):
        raise UsageError(f"--threads is torch threads per rank, 0 (as profiled) to this host's {os.cpu_count() or 1}")
    outputs = [path for path in (args.report, args.save_state, args.timeline, args.trace) if path]
    for k, path in enumerate(outputs):  # now, not after the run; none of them an input or another output
        check_writable(path, [args.plan, args.init_state, *outputs[:k]])
    if args.timeline:  # a picture matplotlib writes (the run failed after training)
        image_format(args.timeline, "--timeline")
    if args.resume and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir")
    if args.resume:  # the marker rank 0 reads: one line here, not a rank's error
        from runtime.checkpoint import CheckpointError, latest

        try:
            done = latest(args.checkpoint_dir, plan.digest(), plan.topology().world_size)
        except CheckpointError as e:
            raise UsageError(str(e)) from None
        if done is None:  # a job restarted with the command it was first launched with: said, not refused
            print(f"note: no checkpoint in {args.checkpoint_dir!r} yet: --resume starts at step 0", file=sys.stderr)
        elif done >= args.steps:  # (it trained nothing and reported 0 ms, exit 0)
            raise UsageError(f"the checkpoint in {args.checkpoint_dir!r} has completed {done} steps, and --steps "
                             f"{args.steps} counts all steps: nothing is left to train; give --steps above {done}")
    from runtime.options import run_refusal, training_options

    options = training_options(args, args.optimizer or plan.optimizer, plan)  # each option checked here, once
    refused = run_refusal(plan, options, bool(args.checkpoint_dir))  # local SGD's, ZeRO-2's and ZeRO-3's rules
    if refused:
        raise UsageError(refused)
    if args.init_state:
        from runtime.initstate import InitState

        InitState(args.init_state)  # readable, a state_dict: one line now rather than from every rank
    if args.save_adapters:
        from runtime.adapters import check_adapters_target

        check_adapters_target(plan, args.save_adapters)


def _shape(topology) -> str:
    """'4 pipeline ranks x 2 replicas', '3 pipeline ranks (2 stages, replicas 1/2)', ..."""
    replicas = [topology.replicas_of(g) for g in range(topology.num_stages)]
    return f"{topology.pipeline_ranks} pipeline ranks" + (
        f" ({topology.num_stages} stages, replicas {'/'.join(map(str, replicas))})" if topology.replicated else "") + (
        f" x {topology.data_parallel} replicas" if topology.data_parallel > 1 else "") + (
        f", {topology.num_stages} stages" if topology.virtual_stages > 1 else "")


def _worker_args(args: argparse.Namespace, out_dir: str, threads: int, optimizer: str) -> List[str]:
    """The command line every rank's `python -m runtime.worker` gets."""
    worker_args = [os.path.abspath(args.plan), "--out-dir", out_dir, "--steps", str(args.steps),
                   "--lr", str(args.lr), "--threads", str(threads), "--optimizer", optimizer, "--measure-link",
                   "--engine", args.engine, "--p2p", args.p2p, *forwarded(args)]
    if args.save_state or args.save_adapters:
        worker_args.append("--save-state")
    if args.init_state:
        worker_args += ["--init-state", os.path.abspath(args.init_state)]
    if args.trace or args.timeline:
        worker_args.append("--trace")
    if args.checkpoint_dir:
        worker_args += ["--checkpoint-dir", os.path.abspath(args.checkpoint_dir),
                        "--checkpoint-every", str(args.checkpoint_every)]
    if args.resume:
        worker_args.append("--resume")
    return worker_args


def _write_outputs(args: argparse.Namespace, plan: Plan, lists: List[List[sched.Action]], out_dir: str,
                   report: Dict[str, Any]) -> None:
    """--save-state, --report, --trace and --timeline, from the ranks' files in out_dir."""
    topology = plan.topology()
    state = _merge_states(out_dir, [topology.global_rank(0, p) for p in topology.primary_ranks()]) \
        if args.save_state or args.save_adapters else None
    if args.save_state:
        import torch

        with atomic_path(args.save_state) as tmp:
            torch.save(state, tmp)
        print(f"saved the trained model's state_dict to {args.save_state}")
    if args.save_adapters:
        from runtime.adapters import write_adapters

        write_adapters(plan, state, args.save_adapters)
        print(f"saved the trained adapters (peft's format) to {args.save_adapters}")
    if args.report:
        write_json_atomic(args.report, report)
        print(f"wrote report {args.report}")
    if args.trace or args.timeline:
        from planner.fidelity.timeline import timeline_png
        from runtime import trace

        events = {r: read_json(os.path.join(out_dir, f"rank{r}.trace.json")) for r in range(topology.world_size)}
        if args.trace:
            trace.chrome_trace(events, args.trace)
            print(f"wrote trace {args.trace} (open it in https://ui.perfetto.dev)")
        if args.timeline:
            _, predicted = plan.simulate_step()
            replica0 = {r: e for r, e in events.items() if topology.replica_of(r) == 0}
            timeline_png(replica0, predicted, step=len(report["steps"]) - 1, path=args.timeline)
            print(f"wrote timeline {args.timeline}")


def _list_text(actions: List[sched.Action]) -> str:
    """The list in its text form, each batch of communication actions in brackets."""
    from runtime.program import COMMUNICATION, batches

    words = []
    for group in batches(actions):
        text = " ".join(str(actions[k]) for k in group)
        words.append(f"[{text}]" if actions[group[0]].kind in COMMUNICATION else text)
    return " ".join(words)


def show(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    lists = check_plan(plan)
    topology = plan.topology()
    if args.json:
        import json

        from runtime.program import actions_json

        print(json.dumps(actions_json(lists)))
        return 0
    for r, actions in enumerate(lists):
        stages = topology.stages_of(r)
        units = [u for g in stages for u in plan.stages[g].units]
        lane = (f", replica {topology.lane_of(r) + 1} of {topology.replicas_of(stages[0])}"
                if topology.replicas_of(stages[0]) > 1 else "")
        print(f"rank {r} (stages {','.join(map(str, stages))}: {units[0]} .. {units[-1]}{lane}), at most "
              f"{sched.max_in_flight(actions)} micro-batches held:")
        print("  " + _list_text(actions))
    print("checked: every send has its receive, and no rank can wait forever (batches in brackets are posted "
          "together)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="runtime", description="Execute a pipeline-parallel plan.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("execute", help="run a plan: one process per stage on this machine")
    ex.add_argument("plan", help="plan JSON from `planner solve`")
    ex.add_argument("--steps", type=int, default=3, help="training steps in all (a resumed run continues to it; default 3)")
    ex.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    add_training_options(ex)
    ex.add_argument("--save-state", metavar="PATH", help="write the trained model's full state_dict here")
    ex.add_argument("--save-adapters", metavar="DIR",
                    help="write a LoRA model's trained adapters alone here, in peft's format "
                         "(PeftModel.from_pretrained(base, DIR) loads them)")
    ex.add_argument("--init-state", metavar="PATH",
                    help="start from this state_dict instead of the seed's weights: a .pt file (torch.save; read "
                         "with weights_only and mmap), .safetensors, or a save_pretrained directory; each rank "
                         "materialises only its stages")
    ex.add_argument("--report", metavar="PATH", help="write the measured-vs-predicted report JSON here")
    ex.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: as profiled)")
    ex.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                    help="optimizer (default: the plan's; options below)")
    ex.add_argument("--timeout", type=float, default=RANK_TIMEOUT_S,
                    help=f"seconds a rank may wait on another before giving up (default {RANK_TIMEOUT_S:g})")
    ex.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace of every rank's actions")
    ex.add_argument("--timeline", metavar="PNG", help="draw the last step's timeline beside the predicted one")
    ex.add_argument("--checkpoint-dir", metavar="DIR", help="save each rank's parameters and optimizer state here")
    ex.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="checkpoint every K steps")
    ex.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --checkpoint-dir")
    ex.add_argument("--engine", choices=ENGINES, default="own",
                    help="own (default): this runtime's engine; torch: each stage in torch.distributed.pipelining's "
                         "PipelineStage, the plan's schedule run by torch's schedule class (docs/runtime.md)")
    ex.add_argument("--p2p", choices=P2P, default="auto", help=P2P_HELP)
    ex.set_defaults(func=execute)
    sh = sub.add_parser("show", help="print and check each rank's instruction list")
    sh.add_argument("plan")
    sh.add_argument("--json", action="store_true",
                    help='print every rank\'s list as JSON: {"ranks": [{"rank", "actions": [{"kind", "micro_batch", '
                         '"stage", "batch" (communication actions posted together share it)}]}]}')
    sh.set_defaults(func=show)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_subcommand(args, (JsonFileError, UsageError, ValueError), "interrupted")


if __name__ == "__main__":
    sys.exit(main())
