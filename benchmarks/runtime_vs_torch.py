"""Step time of this runtime vs torch.distributed.pipelining, same split, same schedule.

    .venv/bin/python benchmarks/runtime_vs_torch.py            # ~4 minutes on 2 busy cores
    .venv/bin/python benchmarks/runtime_vs_torch.py --sizes small --schedules 1f1b --reps 1   # ~30 s

Both systems run the built-in gpt on 2 ranks (gloo, OMP_NUM_THREADS=1, one torch thread per rank),
global batch 16 as 4 micro-batches of 4, the split in the middle of the blocks, SGD (lr 0.01), and
execute the *same* fx GraphModule per stage (`planner.model.capture.capture(module).stage_module(first, end)`):

* ours:   a plan made from `profile_model(entry, args, [4], repeats=1)` with the fixed cut, run with
          `python -m runtime.cli execute plan.json --steps N --report r.json` (`measured_iteration_s`);
* theirs: this file with `--torch-worker`, launched by
          `python -m torch.distributed.run --standalone --nproc-per-node 2` (or, with --launcher, the way
          `runtime execute` starts its ranks, or torch.multiprocessing.spawn); each rank wraps its stage in
          `PipelineStage` and runs `Schedule1F1B` / `ScheduleGPipe` (n_microbatches=4, loss_fn = the spec's
          loss, scale_grads=True, return_outputs=False), then `SGD.step()`.

What is timed is the same on both sides: one training step per rank (make the batch, run every
micro-batch forward and backward, wait for the sends, optimizer step, zero the gradients); a
step's time is the max over the ranks; a run's result is the median over its steady steps (all but
the first, which includes torch's shape inference and both sides' lazy initialisation). The
configurations are run alternately (ours first, then theirs first, ...) `--reps` times; each
repetition's ratio ours/theirs is printed and the table gives the medians. Step 0's loss (before any
update) is compared between the two as a check that they do the same work; so are the later ones
(same data, same exact gradients, same SGD).

On a shared machine whole runs are noisy (other jobs come and go between runs), so the benchmark
also runs an in-process A/B (unless --no-interleaved): in the same 2 processes, our `Engine` (built
as runtime/rank_setup.py builds it) and torch's schedule take one step each in turn, a barrier before
each, so noise hits both alike; it reports the median paired ratio and the CPU time per step.
`--cprofile-dir DIR` profiles each system's steps per rank there; `--also-ours LABEL=ROOT` adds a
column for `runtime execute` from another checkout (to measure a proposed runtime change).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ENTRY = "builtin:gpt"
SIZES: Dict[str, Dict[str, int]] = {
    "small": dict(dim=128, layers=8, vocab=8192, seq_len=64),
    "large": dict(dim=256, layers=8, vocab=16384, seq_len=64),
}
SCHEDULES = ("1f1b", "gpipe")
GLOBAL_BATCH, MICRO_BATCH = 16, 4
LR = 0.01


# --------------------------------------------------------------------------- plans (ours)
def middle_cut(unit_names: List[str]) -> int:
    """The cut before the middle block: gpt with 8 layers -> stage 0 = tok_emb..blocks.3."""
    blocks = [i for i, n in enumerate(unit_names) if n.startswith("blocks.")]
    return blocks[len(blocks) // 2]


def plan_with(profile, boundaries: List[int], micro_batch_size: int, global_batch: int, schedule: str):
    """A plan with the given cuts, not solved."""
    from planner.plan.make import plan_for_split

    return plan_for_split(profile, boundaries, micro_batch_size, global_batch, schedule, "benchmark")


def make_plans(sizes: List[str], schedules: List[str], work: str) -> Dict[tuple, str]:
    import torch

    from planner.plan.file import save_plan
    from planner.profile.measure import profile_model

    torch.set_num_threads(1)
    paths = {}
    for size in sizes:
        t0 = time.perf_counter()
        profile = profile_model(ENTRY, dict(SIZES[size]), [MICRO_BATCH], repeats=1)
        cut = middle_cut([u.name for u in profile.units])
        for schedule in schedules:
            plan = plan_with(profile, [cut], MICRO_BATCH, GLOBAL_BATCH, schedule)
            path = os.path.join(work, f"plan-{size}-{schedule}.json")
            save_plan(plan, path)
            paths[(size, schedule)] = path
        print(f"profiled gpt {size} {SIZES[size]} in {time.perf_counter() - t0:.1f} s; cut before unit {cut} "
              f"({profile.units[cut].name})", flush=True)
    return paths


def _env(root: str = ROOT) -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _steady_median(times: List[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


def run_ours(plan_path: str, steps: int, work: str, tag: str, trace: str = "", root: str = ROOT) -> Dict[str, Any]:
    """`runtime execute` from the checkout at `root` (this one, or a modified copy to compare)."""
    report = os.path.join(work, f"report-{tag}.json")
    cmd = [sys.executable, "-m", "runtime.cli", "execute", plan_path, "--steps", str(steps), "--lr", str(LR),
           "--report", report]
    if trace:
        cmd += ["--trace", trace]
    t0 = time.perf_counter()
    result = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    if result.returncode != 0:
        raise RuntimeError(f"runtime execute failed:\n{result.stdout}\n{result.stderr}")
    with open(report) as f:
        r = json.load(f)
    times = [s["time_s"] for s in r["steps"]]
    return {"median_s": r["measured_iteration_s"], "times_s": times, "losses": [s["loss"] for s in r["steps"]],
            "wall_s": wall}


def run_theirs(plan_path: str, steps: int, work: str, tag: str, launcher: str = "spawn") -> Dict[str, Any]:
    """torch.distributed.pipelining on 2 ranks, started by torch.multiprocessing.spawn (the ranks stay in
    the caller's session, as `runtime execute`'s do) or by torchrun (which puts every rank in a new session)."""
    out = os.path.join(work, f"theirs-{tag}.json")
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.abspath(__file__), "--torch-worker", plan_path, "--steps", str(steps), "--out", out]
    elif launcher == "spawn":
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-spawn", plan_path, "--steps", str(steps),
               "--out", out]
    else:  # popen: both ranks started the way runtime/launch.py starts its workers
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-popen", plan_path, "--steps", str(steps),
               "--out", out]
    t0 = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    if result.returncode != 0:
        raise RuntimeError(f"torch.distributed.pipelining run failed:\n{result.stdout}\n{result.stderr}")
    with open(out) as f:
        r = json.load(f)
    return {"median_s": _steady_median(r["times_s"]), "times_s": r["times_s"], "losses": r["losses"],
            "wall_s": wall}


# --------------------------------------------------------------------------- the two step functions
def _load_plan(plan_path: str):
    from planner.plan.file import load_plan

    return load_plan(plan_path)


def torch_step_fn(plan, rank: int, world: int):
    """torch.distributed.pipelining on this rank's stage: returns step(k) -> mean loss (last rank) or None."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from planner.model.capture import capture
    from planner.model.entry import build_spec

    stages = plan.stages
    assert world == len(stages), f"the plan has {len(stages)} stages, {world} ranks were started"
    model = plan.model
    spec = build_spec(model["entry"], model.get("args", {}), int(model.get("seed", 0)))
    # The same fx GraphModule the runtime cuts out and runs for this stage.
    module, _ = capture(spec.module).stage_module(stages[rank].first_unit, stages[rank].end_unit)
    g, b = plan.global_batch, plan.micro_batch_size
    example = tuple(t[:b] for t in spec.batch(g, 0)[0]) if rank == 0 else None  # first stage's shape inference
    stage = PipelineStage(module, rank, world, torch.device("cpu"), input_args=example)
    schedule_cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[plan.schedule]
    # scale_grads=True: the grads of the summed micro-batch losses are divided by m, as ours divides each loss by m.
    schedule = schedule_cls(stage, n_microbatches=g // b, loss_fn=spec.loss, scale_grads=True)
    optimizer = torch.optim.SGD(list(module.parameters()), lr=LR)

    def step(k: int):
        inputs, target = spec.batch(g, k)
        losses: List[Any] = []
        if rank == 0:
            schedule.step(*inputs, return_outputs=False)
        elif rank == world - 1:
            schedule.step(target=target, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return sum(float(l.detach()) for l in losses) / len(losses) if losses else None

    return step


def our_step_fn(plan, rank: int):
    """This runtime's Engine on this rank, built as runtime/rank_setup.py builds it (for the in-process A/B),
    its messages over gloo as theirs are: `runtime execute` sends through shared memory on one host
    (runtime/shared_memory.py), which the whole-run comparison measures."""
    import torch

    from runtime.engine import Engine
    from runtime.groups import Groups
    from runtime.stage import build_rank

    topology = plan.topology()
    m = plan.num_micro_batches
    rank_model = build_rank(plan, topology, rank)
    actions = plan.instruction_lists()[rank]
    optimizer = torch.optim.SGD(rank_model.parameters(), lr=LR)
    device = torch.device("cpu")
    engine = Engine(rank_model, actions, topology, rank, plan.global_batch, m, optimizer, device,
                    Groups(topology, rank, rank_model.tied_groups), use_tags=True)
    return lambda k: engine.run_step(k).loss


def _init(timeout_s: float = 120.0):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def torch_worker(plan_path: str, steps: int, out: str) -> None:
    """One rank of torch.distributed.pipelining: time every step (batch, schedule.step, SGD step)."""
    import torch.distributed as dist

    rank, world = _init()
    step = torch_step_fn(_load_plan(plan_path), rank, world)
    times, losses = [], []
    dist.barrier()
    for k in range(steps):
        t0 = time.perf_counter()
        losses.append(step(k))
        times.append(time.perf_counter() - t0)
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": times, "losses": losses})
    if rank == 0:
        result = {"times_s": [max(r["times"][j] for r in gathered) for j in range(steps)],
                  "losses": gathered[-1]["losses"], "per_rank_times_s": [r["times"] for r in gathered]}
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def interleaved_worker(plan_path: str, steps: int, out: str, cprofile_dir: str = "") -> None:
    """One rank of the in-process A/B: our Engine and torch's schedule in the same process, on the same
    process group, one step each in turn (order swapped every step, a barrier before each): machine noise
    hits both alike. With cprofile_dir, each system's steps are profiled separately (rank{R}-{system}.pstats)."""
    import cProfile

    import torch.distributed as dist

    rank, world = _init()
    plan = _load_plan(plan_path)
    systems = {"ours": our_step_fn(plan, rank), "theirs": torch_step_fn(plan, rank, world)}
    profilers = {name: cProfile.Profile() for name in systems} if cprofile_dir else {}
    times: Dict[str, List[float]] = {name: [] for name in systems}
    cpu: Dict[str, List[float]] = {name: [] for name in systems}  # this process's CPU time (all its threads)
    losses: Dict[str, List[Any]] = {name: [] for name in systems}
    for k in range(steps):
        for name in (["ours", "theirs"] if k % 2 == 0 else ["theirs", "ours"]):
            dist.barrier()
            if profilers and k > 0:
                profilers[name].enable()
            t0, c0 = time.perf_counter(), time.process_time()
            losses[name].append(systems[name](k))
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if profilers and k > 0:
                profilers[name].disable()
    for name, prof in profilers.items():
        prof.dump_stats(os.path.join(cprofile_dir, f"rank{rank}-{name}.pstats"))
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": times, "cpu": cpu, "losses": losses})
    if rank == 0:
        result = {name: {"times_s": [max(r["times"][name][j] for r in gathered) for j in range(steps)],
                         "cpu_s": [sum(r["cpu"][name][j] for r in gathered) for j in range(steps)],
                         "losses": gathered[-1]["losses"][name]} for name in systems}
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_interleaved(plan_path: str, steps: int, work: str, tag: str, cprofile_dir: str = "") -> Dict[str, Any]:
    out = os.path.join(work, f"interleaved-{tag}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.abspath(__file__), "--interleaved-worker", plan_path, "--steps", str(steps), "--out", out]
    if cprofile_dir:
        os.makedirs(cprofile_dir, exist_ok=True)
        cmd += ["--cprofile-dir", os.path.abspath(cprofile_dir)]
    result = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"interleaved run failed:\n{result.stdout}\n{result.stderr}")
    with open(out) as f:
        r = json.load(f)
    pairs = [a / b for a, b in zip(r["ours"]["times_s"][1:], r["theirs"]["times_s"][1:])]
    return {"ours_ms": _steady_median(r["ours"]["times_s"]) * 1e3,
            "theirs_ms": _steady_median(r["theirs"]["times_s"]) * 1e3,
            "paired_ratio": statistics.median(pairs), "pairs": pairs,
            "ours_cpu_ms": _steady_median(r["ours"]["cpu_s"]) * 1e3,
            "theirs_cpu_ms": _steady_median(r["theirs"]["cpu_s"]) * 1e3,
            "same_losses": max(abs(a - b) for a, b in zip(r["ours"]["losses"], r["theirs"]["losses"])), "raw": r}


def _spawned_rank(rank: int, world: int, port: int, plan_path: str, steps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch_worker(plan_path, steps, out)


def torch_spawn(plan_path: str, steps: int, out: str) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_spawned_rank, args=(2, port, plan_path, steps, out), nprocs=2, join=True)


def torch_popen(plan_path: str, steps: int, out: str) -> None:
    """Start the 2 ranks as runtime/launch.py starts its workers: subprocess.Popen, env:// rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--torch-worker", plan_path,
                                       "--steps", str(steps), "--out", out], env=env, stdin=subprocess.DEVNULL))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a torch.distributed.pipelining rank failed: exit codes {codes}")


# --------------------------------------------------------------------------- driver
def machine() -> str:
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return f"nproc {os.cpu_count()}, {cpu}, torch {torch.__version__}, Python {platform.python_version()}"


def _table(rows: List[dict], extra: List[str]) -> List[str]:
    lines = ["| model | schedule | ours ms | theirs ms | **ours / theirs** | per-run ratios | "
             + "".join(f"{n} ms | {n} / theirs | " for n in extra)
             + "step-0 loss ours / theirs |",
             "|---|---|---:|---:|---:|---|" + "---:|---:|" * len(extra) + "---|"]
    for r in rows:
        m = r["model"]
        lines.append(f"| gpt {r['size']} (dim {m['dim']}, vocab {m['vocab']}, seq {m['seq_len']}) | {r['schedule']} | "
                     f"{r['ms']['ours']:.1f} | {r['ms']['theirs']:.1f} | **{r['ratio']['ours']:.2f}x** | "
                     f"{', '.join(f'{x:.2f}' for x in r['ratios']['ours'])} | "
                     + "".join(f"{r['ms'][n]:.1f} | {r['ratio'][n]:.2f}x | " for n in extra)
                     + f"{r['loss0_ours']:.5f} / {r['loss0_theirs']:.5f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torch-worker", metavar="PLAN", help=argparse.SUPPRESS)  # one rank, under torchrun
    p.add_argument("--torch-spawn", metavar="PLAN", help=argparse.SUPPRESS)  # both ranks, torch.multiprocessing
    p.add_argument("--torch-popen", metavar="PLAN", help=argparse.SUPPRESS)  # both ranks, subprocess.Popen
    p.add_argument("--interleaved-worker", metavar="PLAN", help=argparse.SUPPRESS)  # one rank of the A/B
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=11, help="steps per run; the first is warm-up (default 11)")
    p.add_argument("--reps", type=int, default=2, help="alternating repetitions per configuration (default 2)")
    p.add_argument("--sizes", default="small,large", help=f"comma list of {', '.join(SIZES)} (default: both)")
    p.add_argument("--schedules", default="1f1b,gpipe", help="comma list (default 1f1b,gpipe)")
    p.add_argument("--launcher", choices=["torchrun", "popen", "spawn", "all"], default="torchrun",
                   help="how torch.distributed.pipelining's ranks are started: torchrun (default; it puts each rank "
                        "in a new session), popen (exactly as `runtime execute` starts its workers) or "
                        "torch.multiprocessing.spawn; all: each of them, ratios against torchrun")
    p.add_argument("--also-ours", action="append", default=[], metavar="LABEL=ROOT",
                   help="also run `runtime execute` from another checkout (e.g. a patched copy in /tmp)")
    p.add_argument("--no-interleaved", dest="interleaved", action="store_false",
                   help="skip the in-process A/B (our Engine and torch's schedule alternating step by step in the "
                        "same 2 processes: a noise-robust ratio of the two step loops)")
    p.add_argument("--cprofile-dir", metavar="DIR", help="with --interleaved: cProfile each system per rank into DIR")
    p.add_argument("--json", metavar="PATH", help="write every measurement here")
    args = p.parse_args(argv)
    if args.torch_worker:
        torch_worker(args.torch_worker, args.steps, args.out)
        return 0
    if args.torch_spawn:
        torch_spawn(args.torch_spawn, args.steps, args.out)
        return 0
    if args.torch_popen:
        torch_popen(args.torch_popen, args.steps, args.out)
        return 0
    if args.interleaved_worker:
        interleaved_worker(args.interleaved_worker, args.steps, args.out, args.cprofile_dir or "")
        return 0

    sizes = [s for s in args.sizes.split(",") if s]
    schedules = [s for s in args.schedules.split(",") if s]
    systems: List[tuple] = [("ours", lambda *a: run_ours(*a))]
    for item in args.also_ours:
        label, _, root = item.partition("=")
        systems.append((label, lambda *a, root=os.path.abspath(root): run_ours(*a, root=root)))
    launchers = ["torchrun", "popen", "spawn"] if args.launcher == "all" else [args.launcher]
    for launcher in launchers:
        name = "theirs" if launcher == launchers[0] else f"theirs-{launcher}"
        systems.append((name, lambda *a, launcher=launcher: run_theirs(*a, launcher=launcher)))
    names = [n for n, _ in systems]
    print(f"machine: {machine()}", flush=True)
    start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="rt-vs-torch-")
    plans = make_plans(sizes, schedules, work)
    configs = [(size, sch) for size in sizes for sch in schedules]
    results: Dict[tuple, Dict[str, List[Dict[str, Any]]]] = {c: {n: [] for n in names} for c in configs}
    for rep in range(args.reps):
        for k, config in enumerate(configs):
            order = systems if (rep + k) % 2 == 0 else systems[::-1]  # alternate who goes first
            for name, run in order:
                results[config][name].append(run(plans[config], args.steps, work, f"{config[0]}-{config[1]}-{rep}-{name}"))
            last = {n: results[config][n][-1] for n in names}
            print(f"rep {rep + 1}/{args.reps}  gpt {config[0]:<5} {config[1]:<5}  "
                  + "  ".join(f"{n} {v['median_s'] * 1e3:7.1f} ms ({v['wall_s']:.0f} s)" for n, v in last.items())
                  + f"  ours/theirs {last['ours']['median_s'] / last['theirs']['median_s']:.3f}", flush=True)
    interleaved: Dict[tuple, Dict[str, Any]] = {}
    if args.interleaved:
        for config in configs:
            tag = f"{config[0]}-{config[1]}"
            cdir = os.path.join(args.cprofile_dir, tag) if args.cprofile_dir else ""
            interleaved[config] = r = run_interleaved(plans[config], args.steps, work, tag, cdir)
            print(f"in-process A/B  gpt {config[0]:<5} {config[1]:<5}  ours {r['ours_ms']:7.1f} ms  theirs "
                  f"{r['theirs_ms']:7.1f} ms  paired ratio {r['paired_ratio']:.3f}  CPU ms/step "
                  f"{r['ours_cpu_ms']:.0f} / {r['theirs_cpu_ms']:.0f}", flush=True)

    rows = []
    for config in configs:
        res = results[config]
        ratios = {n: [o["median_s"] / t["median_s"] for o, t in zip(res[n], res["theirs"])] for n in names}
        l_ours, l_theirs = res["ours"][0]["losses"], res["theirs"][0]["losses"]
        rows.append({
            "size": config[0], "schedule": config[1], "model": SIZES[config[0]],
            "ms": {n: statistics.median(r["median_s"] for r in res[n]) * 1e3 for n in names},
            "ratio": {n: statistics.median(ratios[n]) for n in names}, "ratios": ratios,
            "loss0_ours": l_ours[0], "loss0_theirs": l_theirs[0],
            "max_loss_diff_all_steps": max(abs(a - b) for a, b in zip(l_ours, l_theirs)),
            "process_wall_s": {n: statistics.median(r["wall_s"] for r in res[n]) for n in names},
            "interleaved": interleaved.get(config), "runs": res,
        })
    extra = [n for n in names if n not in ("ours", "theirs")]
    print()
    print(f"`runtime execute` vs torch.distributed.pipelining ({launchers[0]}): gpt on 2 ranks (gloo, 1 thread each), "
          f"global batch {GLOBAL_BATCH} = 4 x {MICRO_BATCH}, cut in the middle of the blocks; per run the median of "
          f"{args.steps - 1} steady steps (max over ranks per step); medians of {args.reps} alternating runs")
    print()
    print("\n".join(_table(rows, extra)))
    if interleaved:
        print()
        print(f"in-process A/B (same 2 processes, one step of each in turn, {args.steps - 1} steady steps each):")
        print()
        print("| model | schedule | ours ms | theirs ms | **paired ratio ours / theirs** | steps ours faster "
              "| CPU ms per step, both ranks: ours / theirs (ratio) |")
        print("|---|---|---:|---:|---:|---:|---|")
        for r in rows:
            i = r["interleaved"]
            print(f"| gpt {r['size']} | {r['schedule']} | {i['ours_ms']:.1f} | {i['theirs_ms']:.1f} | "
                  f"**{i['paired_ratio']:.3f}x** | {sum(x < 1 for x in i['pairs'])}/{len(i['pairs'])} | "
                  f"{i['ours_cpu_ms']:.0f} / {i['theirs_cpu_ms']:.0f} ({i['ours_cpu_ms'] / i['theirs_cpu_ms']:.2f}x) |")
    bad = [r for r in rows if abs(r["loss0_ours"] - r["loss0_theirs"]) > 1e-4 * max(1.0, abs(r["loss0_theirs"]))]
    print()
    print(f"losses agree on every step within {max(r['max_loss_diff_all_steps'] for r in rows):.2e}"
          if not bad else f"WARNING: step-0 losses differ for {[(r['size'], r['schedule']) for r in bad]}")
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "steps": args.steps, "reps": args.reps, "launchers": launchers,
                       "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
