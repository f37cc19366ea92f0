"""Measure every partition unit on the target device: the numbers behind `planner profile`.

For each micro-batch size b the whole model runs once to obtain every unit's real inputs;
then each unit runs on its own, as the stage module the runtime would build for it, all units
round-robin (`measure_units`): forward and backward time (median of at least `repeats` rounds and
`min_time_s` seconds after `warmup_s` seconds of warm-up, synchronised on CUDA; optionally with
co-runner processes loading the other cores as other ranks on the host would, `CoRunners`),
bytes saved for backward (counted by saved-tensor hooks as autograd packs them, parameters
excluded, each storage once), parameter bytes, and the bytes of every value crossing each cut.
The last unit's forward includes the loss, as on the runtime's last stage.

`measure_link` times gloo point-to-point messages between two processes on this host at the cut
sizes and fits latency + bytes / bandwidth (`fit_link`): the link `planner solve` then uses.
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from planner.profile.allocator import retain_freed_memory
from planner.model.capture import CaptureError, CapturedModel, capture, run_all_nodes
from planner.profile.corunners import CoRunners, host_kernel_s
from planner.profile.saved import SavedBytes
from planner.profile.profile import CutProfile, CutValue, Profile, UnitProfile
from planner.model.entry import build_spec
from planner.model.spec import ModelSpec, to_device
from planner.profile.hostspeed import REFERENCE_KERNEL, SLOWDOWN_WARN, mean_kernel_s
from planner.profile.optim import OPTIMIZERS, make_optimizer

_CONSTANT_TYPES = (bool, int, float, str, type(None))


def encode_constant(value: Any, where: str) -> Any:
    """A non-tensor value crossing a cut, as JSON (sizes, ints, flags)."""
    if isinstance(value, _CONSTANT_TYPES):
        return value
    if isinstance(value, (tuple, list, torch.Size)):
        return [encode_constant(v, where) for v in value]
    raise CaptureError(
        f"{where} is a {type(value).__name__}, which cannot cross a pipeline cut; "
        "compute it inside one submodule (so it stays within a unit) or return tensors")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unit_step(stage, args: List[Any], produced: List[int], is_last: bool, loss_fn, target, device):
    """Build one forward closure and one backward closure for a unit, timing each."""

    def forward():
        out = stage(*args)
        if is_last:
            return loss_fn(out, target)
        return out

    def backward(out):
        if is_last:
            out.backward()
            return
        tensors = [out[i] for i in produced if isinstance(out[i], torch.Tensor) and out[i].requires_grad]
        if tensors:
            grads = [torch.ones_like(t) for t in tensors]
            torch.autograd.backward(tensors, grads)

    return forward, backward


def measure_unit(stage, args, produced, is_last, loss_fn, target, device, repeats: int, warmup: int = 2):
    """Median forward and backward seconds, and bytes saved for backward, of one unit."""
    [(fwd, bwd, saved)] = measure_units([(stage, args, produced, is_last)], loss_fn, target, device, repeats,
                                        warmup=warmup)
    return fwd, bwd, saved


def measure_units(units, loss_fn, target, device, repeats: int, warmup: int = 2, warmup_s: float = 0.0,
                  min_time_s: float = 0.0):
    """Median forward and backward seconds, and bytes saved for backward, of several units
    [(stage, args, produced, is_last)], measured round-robin: each timed round runs every unit's
    forward then backward once, so slow drifts of the machine (other jobs, frequency) fall on all
    units alike and each unit runs after the others have used the caches, as in a step.
    `warmup` untimed rounds (and at least `warmup_s` seconds of them) come first; then timed
    rounds until there are `repeats` of them and they took at least `min_time_s` seconds."""
    steps = [_unit_step(stage, args, produced, is_last, loss_fn, target, device)
             for stage, args, produced, is_last in units]
    saved = []
    for (stage, *_), (forward, backward) in zip(units, steps):
        counter = SavedBytes(stage.parameters())
        with counter.counting():
            out = forward()
        backward(out)
        saved.append(counter.finish())
    forward_times: List[List[float]] = [[] for _ in units]
    backward_times: List[List[float]] = [[] for _ in units]
    start = time.perf_counter()
    rounds = 0
    while True:
        warming = rounds < warmup or time.perf_counter() - start < warmup_s
        if not warming and not forward_times[0]:
            timed_start = time.perf_counter()
        if not warming and len(forward_times[0]) >= max(repeats, 1) and \
                time.perf_counter() - timed_start >= min_time_s:
            break
        for k, (forward, backward) in enumerate(steps):
            _sync(device)
            t0 = time.perf_counter()
            out = forward()
            _sync(device)
            t1 = time.perf_counter()
            backward(out)
            _sync(device)
            t2 = time.perf_counter()
            if not warming:
                forward_times[k].append(t1 - t0)
                backward_times[k].append(t2 - t1)
            del out
        rounds += 1
    for stage, *_ in units:
        stage.zero_grad(set_to_none=True)
    return [(statistics.median(f), statistics.median(b), s) for f, b, s in zip(forward_times, backward_times, saved)]


def measure_optimizer_steps(unit_params: Sequence[Sequence[torch.Tensor]], device, repeats: int,
                            min_time_s: float = 0.0) -> List[Dict[str, float]]:
    """Median seconds of one optimizer step over each unit's parameters, per optimizer the
    runtime runs ({"sgd": s, "adamw": s}; {} for a unit without parameters). Steps copies of the
    parameters, with gradients set, round-robin over the units after a few untimed rounds (AdamW
    creates its state in its first step), for at least `repeats` rounds and `min_time_s` seconds
    per optimizer."""
    copies = []
    for params in unit_params:
        mine = [p.detach().clone().requires_grad_(True) for p in params]
        for p in mine:
            p.grad = torch.full_like(p, 1e-3)
        copies.append(mine)
    results: List[Dict[str, float]] = [{} for _ in unit_params]
    for name in OPTIMIZERS:
        optimizers = [(k, make_optimizer(name, mine, lr=0.01)) for k, mine in enumerate(copies) if mine]
        times: Dict[int, List[float]] = {k: [] for k, _ in optimizers}
        start, rounds = time.perf_counter(), 0
        while optimizers and (rounds < 3 + max(repeats, 1) or time.perf_counter() - start < min_time_s):
            for k, optimizer in optimizers:
                _sync(device)
                t0 = time.perf_counter()
                optimizer.step()
                _sync(device)
                if rounds >= 3:
                    times[k].append(time.perf_counter() - t0)
            rounds += 1
        for k, values in times.items():
            results[k][name] = statistics.median(values)
    return results


def _whole_model_item(captured: CapturedModel, values: Dict[str, Any], device):
    """(stage, args, produced, is_last) of all units as one stage, as a 1-stage run calls it."""
    stage, io = captured.stage_module(0, len(captured.units))
    return stage, _prepare_args(values, io.inputs, {}, device), [], True


def _prepare_args(values: Dict[str, Any], names: Sequence[str], grad_flags: Dict[str, bool], device) -> List[Any]:
    args = []
    for name in names:
        v = values[name]
        if isinstance(v, torch.Tensor):
            v = v.detach().to(device)
            if grad_flags.get(name, False):
                v.requires_grad_(True)
        args.append(v)
    return args


def record_cut_values(captured: CapturedModel, values: Dict[str, Any], b: int, grad_flags: Dict[str, bool],
                      cut_values: Dict[int, Dict[str, CutValue]]) -> None:
    """Add micro-batch size b's shapes, bytes and constants of every value crossing every cut
    (from one run's node values) to `cut_values[k][name]`, creating records on first sight."""
    for k in range(1, len(captured.units)):
        for node in captured.crossing(k):
            v = values[node.name]
            record = cut_values[k].setdefault(node.name, CutValue(
                name=node.name, kind="tensor" if isinstance(v, torch.Tensor) else "constant"))
            if isinstance(v, torch.Tensor):
                record.dtype = str(v.dtype).replace("torch.", "")
                record.requires_grad = grad_flags.get(node.name, False) and v.is_floating_point()
                record.shape[b] = list(v.shape)
                record.bytes[b] = _tensor_bytes(v)
            else:
                record.value[b] = encode_constant(v, f"value {node.name!r} crossing cut {k}")


def shared_parameters_json(captured: CapturedModel) -> List[Dict[str, Any]]:
    """Tied weights for the profile: each unit using one counts its bytes in its param_bytes."""
    return [{"name": p.name, "names": p.names, "units": p.units, "bytes": p.bytes}
            for p in captured.shared_parameters()]


def profile_model(
    entry: str,
    model_args: Dict[str, Any],
    micro_batch_sizes: Sequence[int],
    device: str = "cpu",
    seed: int = 0,
    threads: int = 1,
    repeats: int = 5,
    progress: Optional[Callable[[str], None]] = None,
    warmup_s: float = 0.0,
    min_time_s: float = 0.0,
    co_runners: int = 0,
    whole_model: bool = True,
) -> Profile:
    """Capture and measure a model; return its profile (nothing written).

    Units are timed round-robin (`measure_units`) after `warmup_s` seconds of warm-up rounds,
    for at least `repeats` rounds and `min_time_s` seconds per micro-batch size. With
    `co_runners` > 0 (CPU only), that many other processes run the same model's training step
    at the same micro-batch size meanwhile, with the same threads each: the contention for
    cores, caches and memory bandwidth that ranks sharing a host see. What the profile was
    measured under is recorded in its `measured_under`. With `whole_model`, the whole model is
    timed as one more item of every round: a unit timed alone pays a call's fixed cost that a
    stage pays once, which the profile keeps apart as `stage_overhead_s` (`split_call_overhead`,
    forward and backward apart), so that the units and that cost sum to the whole model."""
    say = progress or (lambda msg: None)
    dev = torch.device(device)
    if co_runners < 0:
        raise ValueError(f"co_runners must be >= 0 (got {co_runners})")
    if co_runners and dev.type != "cpu":
        raise CaptureError("co-runners (--ranks-per-host > 1) model ranks sharing a CPU host; they apply to "
                           "--device cpu only")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CaptureError("--device cuda was asked for but CUDA is not available here; use --device cpu")
    if threads > 0:
        torch.set_num_threads(threads)
    retain_freed_memory()  # as every rank does: measure without per-micro-batch page faults
    spec: ModelSpec = build_spec(entry, model_args, seed)
    captured: CapturedModel = capture(spec.module)
    captured.gm.to(dev)
    L = len(captured.units)
    if captured.fallback_reason:
        say(f"torch.fx failed ({captured.fallback_reason}); used torch.export")
    say(f"captured {type(spec.module).__name__} with {'torch.fx' if captured.method == 'fx' else 'torch.export'}: "
        f"{L} units ({', '.join(captured.unit_names[:6])}{', …' if L > 6 else ''})")

    stages = [captured.stage_module(k, k + 1) for k in range(L)]
    sizes = sorted(set(int(b) for b in micro_batch_sizes))

    # Which crossing values carry gradients: one forward with autograd on, at the smallest size.
    inputs0, _ = spec.batch(sizes[0], 0)
    with torch.enable_grad():
        probe = run_all_nodes(captured, to_device(tuple(inputs0), dev), grad=True)
    grad_flags = {n: bool(isinstance(v, torch.Tensor) and v.requires_grad) for n, v in probe.items()}
    del probe

    unit_records = [UnitProfile(name=u.name, param_bytes=sum(_tensor_bytes(p) for p in stages[k][0].parameters()),
                                forward_s={}, backward_s={}, saved_bytes={}, output_bytes={},
                                nodes=[n.name for n in u.nodes])
                    for k, u in enumerate(captured.units)]
    cut_values: Dict[int, Dict[str, CutValue]] = {k: {} for k in range(1, L)}
    co = CoRunners(entry, model_args, seed, threads, co_runners) if co_runners > 0 else None
    whole_scale: Dict[int, Dict[str, float]] = {}
    stage_overhead: Dict[int, Tuple[float, float]] = {}
    host_kernel: List[Optional[float]] = []
    try:
        if co is not None:
            say(f"started {co_runners} co-runner process(es): the same model's training step on the other "
                f"core(s) while measuring, as a {co_runners + 1}-rank run on this host has")
        host_kernel.append(host_kernel_s(co, dev))
        for b in sizes:
            inputs, target = spec.batch(b, 0)
            inputs, target = to_device(tuple(inputs), dev), to_device(target, dev)
            values = run_all_nodes(captured, inputs)
            record_cut_values(captured, values, b, grad_flags, cut_values)
            work, produced_of = [], []
            for k, (stage, io) in enumerate(stages):
                args = _prepare_args(values, io.inputs + io.received,
                                     {n: cut_values[k][n].requires_grad for n in io.received} if k else {}, dev)
                own = {n.name for n in captured.units[k].nodes}
                produced = [i for i, name in enumerate(io.sent) if name in own]
                work.append((stage, args, produced, io.is_last))
                produced_of.append(produced)
            if co is not None:
                co.load(b)
            # The whole model, one call, timed in the same rounds: a unit timed alone pays a call's
            # fixed cost (module call, autograd.backward, the seed gradient) that a stage of several
            # units pays once (resnet: the sum of its 6 units is 8 % above the whole, gpt 3 %).
            whole = _whole_model_item(captured, values, dev) if whole_model else None
            try:
                measured = measure_units(work + ([whole] if whole else []), spec.loss, target, dev, repeats,
                                         warmup_s=warmup_s, min_time_s=min_time_s)
            except torch.cuda.OutOfMemoryError:
                if whole is None:
                    raise
                whole = None  # the model does not fit as one stage here: unit times as measured
                torch.cuda.empty_cache()
                measured = measure_units(work, spec.loss, target, dev, repeats, warmup_s=warmup_s,
                                         min_time_s=min_time_s)
            if whole is not None:
                (whole_f, whole_b, _), measured = measured[-1], measured[:-1]
                call_f, forwards, scale_f = split_call_overhead([f for f, _, _ in measured], whole_f)
                call_b, backwards, scale_b = split_call_overhead([g for _, g, _ in measured], whole_b)
                whole_scale[b] = {"forward": scale_f, "backward": scale_b}
                stage_overhead[b] = (call_f, call_b)
                measured = [(f, g, s) for f, g, (_, _, s) in zip(forwards, backwards, measured)]
            for k, ((stage, io), (fwd, bwd, saved)) in enumerate(zip(stages, measured)):
                unit = unit_records[k]
                unit.forward_s[b], unit.backward_s[b], unit.saved_bytes[b] = fwd, bwd, saved
                unit.output_bytes[b] = sum(_tensor_bytes(values[io.sent[i]]) for i in produced_of[k]
                                           if isinstance(values[io.sent[i]], torch.Tensor))
                say(f"  b={b:<4} unit {k + 1:>3}/{L} {unit.name:<24} forward {fwd * 1e3:8.3f} ms  "
                    f"backward {bwd * 1e3:8.3f} ms  saved {saved / 2**20:8.2f} MiB")
            if b in stage_overhead:
                say(f"  b={b:<4} a stage's own cost per micro-batch (whole model vs its units timed alone): "
                    f"forward {stage_overhead[b][0] * 1e3:.3f} ms  backward {stage_overhead[b][1] * 1e3:.3f} ms")
            del values, work
        # under the same load as the units: the ranks step their optimizers while the others compute
        steps = measure_optimizer_steps([list(stage.parameters()) for stage, _ in stages], dev, repeats,
                                        min_time_s=min(min_time_s, 0.5))
        for unit, step in zip(unit_records, steps):
            unit.optimizer_s = step
        totals = {name: sum(step.get(name, 0.0) for step in steps) for name in OPTIMIZERS}
        say("  optimizer step over all units: " + ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in totals.items()))
        host_kernel.append(host_kernel_s(co, dev))
        if host_kernel[0]:  # whether it drifted too far is steadiest_profile's to judge
            say(f"  host speed: reference kernel {host_kernel[0] * 1e6:.0f} us before, {host_kernel[1] * 1e6:.0f} us "
                "after")
    finally:
        if co is not None:
            co.stop()
    cuts = [CutProfile(before_unit=k, values=[cut_values[k][n.name] for n in captured.crossing(k)])
            for k in range(1, L)]
    return Profile(
        model={"entry": entry, "args": dict(model_args), "seed": seed},
        micro_batch_sizes=sizes,
        units=unit_records,
        cuts=cuts,
        device=dev.type,
        device_name=_device_name(dev),
        threads=torch.get_num_threads(),
        dtype=str(next((p.dtype for p in spec.module.parameters()), torch.float32)).replace("torch.", ""),
        torch_version=torch.__version__,
        capture=captured.method,
        repeats=repeats,
        extra={"python": sys.version.split()[0], "shared_parameters": shared_parameters_json(captured),
               "measured_under": {"threads": torch.get_num_threads(), "repeats": repeats, "warmup_s": warmup_s,
                                  "min_time_s": min_time_s, "order": "round-robin", "co_runners": co_runners,
                                  "co_runner_load": "the model's training step at the measured micro-batch size"
                                  if co_runners else None, "cpu_count": os.cpu_count(),
                                  "whole_model_scale": {str(b): s for b, s in whole_scale.items()} or None,
                                  "host_kernel": {"kernel": REFERENCE_KERNEL, "before_s": host_kernel[0],
                                                  "after_s": host_kernel[1], "mean_s": mean_kernel_s(host_kernel)}
                                  if host_kernel[0] else None}},
        stage_overhead_s=stage_overhead,
    )


def split_call_overhead(alone: Sequence[float], whole: float) -> Tuple[float, List[float], float]:
    """(c, unit times t, scale): a stage of units S costs sum_{l in S} t_l + c, and the whole model
    sum_l t_l + c = `whole`, from each unit's time timed alone (`alone`) and the whole model's.

    A unit timed alone pays a call's fixed cost c that a stage of several units pays once, so
    alone_l = t_l + c and sum_l alone_l - whole = (L - 1) c. c is at most the cheapest unit's time
    (no unit costs less than nothing) and at least 0; what c does not explain is spread over the
    units in proportion to their time (scale, 1 when c explains it all):
    t_l = (alone_l - c) (whole - c) / (sum_l alone_l - L c)."""
    L, total = len(alone), sum(alone)
    c = min((total - whole) / (L - 1), min(alone)) if L > 1 and whole > 0 and total > whole else 0.0
    rest = total - L * c
    if rest <= 0 or whole - c <= 0:
        c, rest = 0.0, total
    scale = (whole - c) / rest if rest > 0 else 1.0
    return c, [(t - c) * scale for t in alone], scale


def host_drift(profile: Profile) -> float:
    """|after / before - 1| of the host-speed reference kernel the profile timed around its
    measurement (0 where it did not: off CPU, older profiles)."""
    host = profile.host_kernel
    return abs(host["after_s"] / host["before_s"] - 1.0) if host.get("before_s") and host.get("after_s") else 0.0


def steadiest_profile(measure: Callable[[], Profile], retries: int,
                      progress: Optional[Callable[[str], None]] = None) -> Profile:
    """`measure()` again, at most `retries` more times, while the host's speed drifted by more than
    SLOWDOWN_WARN during it (a shared machine's slow spell began or ended: some units were timed
    at one speed, some at another); the attempt that drifted least is kept, its count recorded."""
    say = progress or (lambda msg: None)
    attempts = [measure()]
    while host_drift(attempts[-1]) > SLOWDOWN_WARN and len(attempts) <= retries:
        say(f"host speed drifted {host_drift(attempts[-1]) * 100:.0f} % while profiling: profiling again "
            f"(attempt {len(attempts) + 1} of {retries + 1})")
        attempts.append(measure())
    best = min(attempts, key=host_drift)
    if host_drift(best) > SLOWDOWN_WARN:
        say(f"host speed drifted in every attempt; keeping the steadiest ({host_drift(best) * 100:.0f} %): "
            "profile again when the machine is quiet")
    under = best.extra.setdefault("measured_under", {})
    under["attempts"] = len(attempts)
    return best


# --- the link between two ranks on this host -------------------------------------------------
def fit_link(samples: Sequence[Sequence[float]]) -> Dict[str, float]:
    """Fit one-way message time = latency + bytes / bandwidth to [(bytes, seconds), ...] (at least
    two distinct sizes), minimising relative residuals (weights 1 / t^2), so the small messages
    pipeline cuts mostly are fit as well as the large one. Latency is clamped to >= 0 (the
    bandwidth refit through the origin then); a non-positive slope (time not growing with size)
    raises ValueError: no bandwidth can be read from such samples."""
    points = [(float(n), float(t)) for n, t in samples]
    if len({n for n, _ in points}) < 2:
        raise ValueError("fitting a link needs messages of at least two sizes")
    if any(not t > 0 for _, t in points):
        raise ValueError("message times must be positive")
    w = [1.0 / (t * t) for _, t in points]
    sw = sum(w)
    mean_n = sum(wi * n for wi, (n, _) in zip(w, points)) / sw
    mean_t = sum(wi * t for wi, (_, t) in zip(w, points)) / sw
    var = sum(wi * (n - mean_n) ** 2 for wi, (n, _) in zip(w, points))
    slope = sum(wi * (n - mean_n) * (t - mean_t) for wi, (n, t) in zip(w, points)) / var
    latency = mean_t - slope * mean_n
    if latency < 0:
        latency = 0.0
        slope = sum(wi * n * t for wi, (n, t) in zip(w, points)) / sum(wi * n * n for wi, (n, _) in zip(w, points))
    if not slope > 0:
        raise ValueError("message time does not grow with size in these samples; measure larger messages")
    return {"latency_s": latency, "bandwidth_bytes_per_s": 1.0 / slope}


def link_worker_main(argv: Optional[Sequence[str]] = None) -> None:
    """One side of `measure_link`: rank 0 ping-pongs each size with rank 1 over gloo and prints
    [[bytes, one-way seconds (median of round trips / 2)], ...] as JSON."""
    import datetime
    import json

    import torch.distributed as dist

    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    rank, port = int(config["rank"]), int(config["port"])
    torch.set_num_threads(max(int(config["threads"]), 1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=float(config["timeout_s"])))
    try:
        samples = ping_pong(rank == 0, 1 - rank, config["sizes"], int(config["repeats"]), int(config["warmup"]))
        dist.barrier()
        if rank == 0:
            print(json.dumps(samples), flush=True)
    finally:
        dist.destroy_process_group()


def ping_pong(leader: bool, peer: int, message_bytes: Sequence[int], repeats: int, warmup: int,
              tag: int = 0) -> List[List[float]]:
    """[[bytes, one-way seconds], ...]: the median round trip / 2 of each size between this rank
    and `peer` in the default process group (the leader sends first; the peer runs the same call
    with leader=False). Sizes are interleaved round after round, so a burst of noise on the host
    hits every size alike."""
    import torch.distributed as dist

    buffers = [torch.zeros(max(int(n) // 4, 1), dtype=torch.float32) for n in message_bytes]
    times: List[List[float]] = [[] for _ in buffers]
    for i in range(warmup + max(repeats, 1)):
        for k, buffer in enumerate(buffers):
            t0 = time.perf_counter()
            if leader:
                dist.send(buffer, peer, tag=tag)
                dist.recv(buffer, peer, tag=tag)
            else:
                dist.recv(buffer, peer, tag=tag)
                dist.send(buffer, peer, tag=tag)
            if i >= warmup:
                times[k].append((time.perf_counter() - t0) / 2)
    return [[_tensor_bytes(buffer), statistics.median(t)] for buffer, t in zip(buffers, times)]


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_link(message_bytes: Sequence[int], threads: int = 1, repeats: int = 30, warmup: int = 3,
                 timeout_s: float = 60.0) -> Dict[str, Any]:
    """Point-to-point cost between two processes on this host, as two ranks of a CPU run have it:
    gloo send/recv over loopback, ping-pong at each of `message_bytes` (the plan's real cut sizes,
    plus a small and a large message for the fit), `repeats` rounds over all sizes after `warmup`;
    each size's one-way time is the median of its round trips / 2.
    Returns {"latency_s", "bandwidth_bytes_per_s", "samples": [[bytes, one-way s], ...], ...}."""
    import json
    import subprocess

    sizes = sorted({max(int(n), 4) for n in message_bytes} | {8, 4 << 20})
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS=str(max(threads, 1)))
    code = "from planner.profile.measure import link_worker_main; link_worker_main()"
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(
        {"rank": r, "port": port, "threads": threads, "sizes": sizes, "repeats": repeats, "warmup": warmup,
         "timeout_s": timeout_s})], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        for r in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s + 30)
            if proc.returncode != 0:
                raise RuntimeError(f"measuring the link failed: {(err.strip().splitlines() or ['?'])[-1]}")
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    samples = json.loads(outputs[0])
    fit = fit_link(samples)
    return dict(fit, backend="gloo", between="two processes on this host (loopback)", threads=threads,
                repeats=repeats, samples=samples)
