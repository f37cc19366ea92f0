"""The link between two ranks on this host: point-to-point messages timed between two processes
(through the transport a run gives them: shared memory, or gloo with --p2p gloo) at the cut sizes,
fit as latency + bytes / bandwidth (`planner profile --link measure`, and every run's ranks 0 and
1); and the data-parallel all-reduce between the same two processes at the runtime's gradient
bucket size, whose rate is what a plan's gradient exchange runs at."""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from planner.profile.rhythm import rhythm_message_cost, stand_in, summarise


class FlatLinkError(ValueError):
    """The message times do not grow with size: noise (a loaded host) hid the per-byte cost."""


def fit_link(samples: Sequence[Sequence[float]]) -> Dict[str, float]:
    """Fit one-way message time = latency + bytes / bandwidth to [(bytes, seconds), ...] (at least
    two distinct sizes, finite sizes and positive finite times, else ValueError), minimising
    relative residuals (weights 1 / t^2), so the small messages pipeline cuts mostly are fit as
    well as the large one. Latency is clamped to >= 0 (the bandwidth refit through the origin
    then); a non-positive slope (time not growing with size) raises FlatLinkError: no bandwidth
    can be read from such samples."""
    points = _checked_points(samples)
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
        raise FlatLinkError("message time does not grow with size in these samples; measure larger messages")
    return {"latency_s": latency, "bandwidth_bytes_per_s": 1.0 / slope}


def _checked_points(samples: Sequence[Sequence[float]]) -> List[Tuple[float, float]]:
    """[(bytes, seconds), ...] as floats, or ValueError for samples no fit can take."""
    points = [(float(n), float(t)) for n, t in samples]
    if any(not (math.isfinite(n) and math.isfinite(t)) for n, t in points):
        raise ValueError("message sizes and times must be finite numbers")
    if len({n for n, _ in points}) < 2:
        raise ValueError("fitting a link needs messages of at least two sizes")
    if any(not t > 0 for _, t in points):
        raise ValueError("message times must be positive")
    return points


def bounding_link_fit(samples: Sequence[Sequence[float]]) -> Dict[str, float]:
    """The fit when the samples' times do not grow with size: latency = the smallest message's
    time, bandwidth = the largest message's bytes / its whole time (a floor: its latency counted
    as transfer): the smallest and the largest message are predicted at or above their own times,
    a slow link rather than a free one. Invalid samples raise ValueError as in fit_link."""
    points = _checked_points(samples)
    latency = min(points)[1]
    largest, seconds = max(points)
    return {"latency_s": latency, "bandwidth_bytes_per_s": largest / seconds}


def fit_measured_link(measure: Callable[[], Dict[str, Any]],
                      attempts: int = 3) -> Tuple[Dict[str, Any], Dict[str, float], Optional[str]]:
    """(measurement, fit, warning): `measure()` ({"samples": [[bytes, s], ...], ...}) fit by
    fit_link; when its times do not grow with size (one noisy ping-pong on a loaded host) it is
    measured again, up to `attempts` times in all, and the last one is then fit by
    bounding_link_fit with a warning saying so (warning None otherwise). Invalid samples still
    raise ValueError."""
    attempts = max(int(attempts), 1)
    for _ in range(attempts):
        measured = measure()
        try:
            return measured, fit_link(measured["samples"]), None
        except FlatLinkError:
            pass  # measured again, or bounded below after the last attempt
    fit = bounding_link_fit(measured["samples"])
    return measured, fit, (
        f"the link's message times did not grow with size in {attempts} measurement(s) (a loaded host?); "
        f"using latency = the smallest message's time ({fit['latency_s'] * 1e6:.0f} us) and bandwidth = the "
        f"largest message's rate ({fit['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s); measure again on a quiet "
        "host or give planner solve --bandwidth/--latency")


def dist_post(operations: Sequence[Tuple[bool, torch.Tensor, int, int]]) -> List[Any]:
    """Post (send?, tensor, peer, tag) operations together through torch.distributed
    (batch_isend_irecv); their works. The default `post` of the measurements below; a run's
    transport (runtime.comm.post, shared memory between the ranks of one host) is handed in by
    runtime.link_probe, the processes `measure_link` starts."""
    import torch.distributed as dist

    return list(dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, tensor, peer, tag=tag)
                                        for send, tensor, peer, tag in operations]))


Post = Callable[[Sequence[Tuple[bool, torch.Tensor, int, int]]], List[Any]]


def measure_pair(rank: int, config: Dict[str, Any], ping: Optional[Callable[[], List[List[float]]]] = None,
                 post: Optional[Post] = None, reduce: Optional[Callable[[torch.Tensor], None]] = None
                 ) -> Dict[str, Any]:
    """Both ranks of the pair (the default process group), each calling it: the ping-pong (`ping`,
    default ping_pong at the config's sizes: [[bytes, one-way seconds], ...]), measured again while
    its times do not grow with size (fit_measured_link, up to the config's "attempts": both ranks
    decide on rank 0's samples), then once each the batches and the all-reduces (the rhythm, through
    the engine: runtime.link_probe). The point-to-point messages go through `post` (dist_post's
    signature) when given, as a run's do, and the all-reduces through `reduce` (an in-place sum over
    the pair), as a run's gradient buckets do.
    {"samples", "fit", "warning", "ping_pongs" (how many ran), "batches", "allreduce"}."""
    import torch.distributed as dist

    repeats, warmup = int(config["repeats"]), int(config["warmup"])
    batched = post or dist_post  # the batches post as the runtime does
    if ping is None:
        ping = lambda: ping_pong(rank == 0, 1 - rank, config["sizes"], repeats, warmup, post=post)  # noqa: E731
    pings = 0

    def agreed() -> Dict[str, Any]:
        nonlocal pings
        shared = [ping()]
        dist.broadcast_object_list(shared, src=0)  # rank 0's round trips: both ranks retry alike
        pings += 1
        return {"samples": shared[0]}

    measured, fit, warning = fit_measured_link(agreed, int(config.get("attempts", 1)))
    return {"samples": measured["samples"], "fit": fit, "warning": warning, "ping_pongs": pings,
            "batches": batch_exchange(1 - rank, BATCH_COUNTS, repeats, warmup, post=batched),
            "allreduce": all_reduce_times(config["allreduce_sizes"], int(config["allreduce_repeats"]), 1,
                                          reduce=reduce)}


def _timed_rounds(message_bytes: Sequence[int], repeats: int, warmup: int, device: Optional[torch.device],
                  exchange, share: float = 1.0) -> List[List[float]]:
    """[[bytes, seconds], ...]: the median time of `exchange(buffer)` for a buffer of each size, times
    `share`, sizes interleaved round after round (a burst of noise on the host hits every size
    alike); on a CUDA `device` the buffers live there and each exchange ends with a synchronisation."""
    device = device or torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    buffers = [torch.zeros(max(int(n) // 4, 1), dtype=torch.float32, device=device) for n in message_bytes]
    times: List[List[float]] = [[] for _ in buffers]
    for i in range(warmup + max(repeats, 1)):
        for k, buffer in enumerate(buffers):
            t0 = time.perf_counter()
            exchange(buffer)
            sync()
            if i >= warmup:
                times[k].append((time.perf_counter() - t0) * share)
    return [[buffer.numel() * buffer.element_size(), statistics.median(t)] for buffer, t in zip(buffers, times)]


def ping_pong(leader: bool, peer: int, message_bytes: Sequence[int], repeats: int, warmup: int,
              tag: int = 0, device: Optional[torch.device] = None, post: Optional[Post] = None) -> List[List[float]]:
    """[[bytes, one-way seconds], ...]: the median round trip / 2 of each size between this rank
    and `peer` in the default process group (the leader sends first; the peer runs the same call
    with leader=False). On a CUDA `device` the buffers live there (NCCL). Through `post`
    (dist_post's signature: a run's transport) where given, else torch.distributed's send/recv."""
    import torch.distributed as dist

    def round_trip(buffer: torch.Tensor) -> None:
        if post is not None:
            for send in (leader, not leader):
                for work in post([(send, buffer, peer, tag)]):
                    work.wait()
        elif leader:
            dist.send(buffer, peer, tag=tag)
            dist.recv(buffer, peer, tag=tag)
        else:
            dist.recv(buffer, peer, tag=tag)
            dist.send(buffer, peer, tag=tag)

    return _timed_rounds(message_bytes, repeats, warmup, device, round_trip, share=0.5)


BATCH_COUNTS = (1, 8)  # messages each way in one batch, for the per-message cost


def batch_exchange(peer: int, counts: Sequence[int], repeats: int, warmup: int,
                   device: Optional[torch.device] = None, post: Post = dist_post) -> List[List[float]]:
    """[[messages each way, seconds], ...]: both ranks post k tiny sends and k receives to each
    other as one batch (`post`, as the runtime posts a batch) and wait for all of it; the median
    time of each k, counts interleaved round after round."""
    device = device or torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: List[List[float]] = [[] for _ in counts]
    for i in range(warmup + max(repeats, 1)):
        for j, k in enumerate(counts):
            out = [torch.zeros(1, device=device) for _ in range(k)]
            into = [torch.empty(1, device=device) for _ in range(k)]
            ops = [(True, t, peer, 0) for t in out] + [(False, t, peer, 0) for t in into]
            t0 = time.perf_counter()
            for work in post(ops):
                work.wait()
            sync()
            if i >= warmup:
                times[j].append(time.perf_counter() - t0)
    return [[k, statistics.median(t)] for k, t in zip(counts, times)]


# The runtime's gradient bucket (runtime.groups.GradientBuckets' default) and a small one: the
# gradient exchange of a plan runs as full buckets plus one partial bucket per rank.
BUCKET_BYTES = 25 << 20
ALLREDUCE_BYTES = (1 << 20, BUCKET_BYTES)


def all_reduce_times(message_bytes: Sequence[int], repeats: int, warmup: int, device: Optional[torch.device] = None,
                     reduce: Optional[Callable[[torch.Tensor], None]] = None) -> List[List[float]]:
    """[[bytes, seconds], ...]: the median time of an all-reduce (sum) of each size over the
    default group (through `reduce` when given), sizes interleaved round after round, each ended
    by waiting for it."""
    import torch.distributed as dist

    return _timed_rounds(message_bytes, repeats, warmup, device, reduce or (lambda buffer: dist.all_reduce(buffer)))


def all_reduce_rate(samples: Sequence[Sequence[float]]) -> float:
    """Bytes per second each of two holders moves in an all-reduce at the largest size timed (a
    full gradient bucket): at n = 2 a ring all-reduce of S bytes sends 2 (n - 1) / n S = S bytes
    per holder, so the rate is S / t -- the bus bandwidth planner.cost.memory's traffic is divided
    by. The per-bucket latency is in it, amortised as the runtime's full buckets have it."""
    size, seconds = max(samples)
    if not (size > 0 and seconds > 0):
        raise ValueError("an all-reduce rate needs a positive size and time")
    return float(size) / float(seconds)


def fit_message_cost(batches: Sequence[Sequence[float]]) -> float:
    """Seconds per operation in a batch (each side posts 2k operations for k messages each way),
    from the batch times at the smallest and largest k; >= 0."""
    (k0, t0), (k1, t1) = min(batches), max(batches)
    if k1 <= k0:
        raise ValueError("fitting the per-message cost needs batches of at least two sizes")
    return max(0.0, (t1 - t0) / (2 * (k1 - k0)))


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_link(message_bytes: Sequence[int], threads: int = 1, repeats: int = 30, warmup: int = 3,
                 timeout_s: float = 60.0, attempts: int = 3,
                 rhythm: Optional[Sequence[float]] = None, p2p: str = "auto") -> Dict[str, Any]:
    """Point-to-point cost between two processes on this host, as two ranks of a CPU run have it
    (`p2p` as `runtime execute --p2p`: auto, shared memory where the machine allows it, else gloo
    over loopback; "p2p" in the result says which), ping-pong at each of `message_bytes` (the plan's real cut sizes,
    plus a small and a large message for the fit), `repeats` rounds over all sizes after `warmup`;
    each size's one-way time is the median of its round trips / 2.
    Then batches of 1 and 8 tiny messages each way posted together, back to back, give the bare
    transport's cost per operation in a batch (`transport_message_s`).
    Last, all-reduces of 1 MiB and of the runtime's gradient bucket between the two processes:
    `allreduce.bandwidth_bytes_per_s` is the rate of the data-parallel gradient exchange.
    The ping-pong alone is measured again (up to `attempts` in all, in the same two processes) when
    its times do not grow with size, then fit by bounding_link_fit, with "warning" saying so
    (fit_measured_link, measure_pair).
    With `rhythm` = (forward s, backward s) of a stage per micro-batch, the two processes then run
    a two-stage step's lists with that much stand-in compute on both, every batch of messages
    through the runtime's engine (runtime.message_rhythm): `rhythm.message_s` is the cost per
    operation with which the step graph of those lists takes the measured step
    (planner.profile.rhythm.rhythm_message_cost), and `message_s`, what a plan charges per operation
    besides latency and transfer, is the larger of it and the transport's (without a rhythm, the
    transport's). `rhythm.latency_s` reads the same step as a one-way latency (recorded, not charged).
    Returns {"latency_s", "bandwidth_bytes_per_s", "message_s", "transport_message_s", "samples": [[bytes, one-way s], ...],
    "batches": [[messages, s], ...], "allreduce": {"bandwidth_bytes_per_s", "samples"}, ...}."""
    sizes = sorted({max(int(n), 4) for n in message_bytes} | {8, 4 << 20})
    rhythm = stand_in(*rhythm) if rhythm else None  # the compute the workers time (capped once, here)
    measured = _run_link_workers(sizes, threads, repeats, warmup, timeout_s, attempts, rhythm, p2p)
    fit, warning = measured["fit"], measured["warning"]
    reduced = measured["allreduce"]
    transport = fit_message_cost(measured["batches"])
    message = transport
    if measured.get("rhythm"):
        record = summarise(measured["rhythm"], *rhythm)
        record["message_s"] = rhythm_message_cost(record["step_s"], *rhythm, fit["latency_s"], record["micro_batches"])
        fit, message = dict(fit, rhythm=record), max(transport, record["message_s"])
    return dict(fit, message_s=message, transport_message_s=transport, backend="gloo", p2p=measured["p2p"],
                between="two processes on this host", threads=threads, repeats=repeats,
                samples=measured["samples"], batches=measured["batches"],
                allreduce={"bandwidth_bytes_per_s": all_reduce_rate(reduced), "samples": reduced, "members": 2,
                           "transport": measured.get("allreduce_p2p", "gloo")},
                **({"warning": warning} if warning else {}))


def _run_link_workers(sizes: Sequence[int], threads: int, repeats: int, warmup: int, timeout_s: float,
                      attempts: int, rhythm: Optional[Sequence[float]] = None, p2p: str = "auto") -> Dict[str, Any]:
    """The two runtime.link_probe processes: rank 0's printed JSON (measure_pair's, and "p2p")."""
    import json
    import subprocess

    import glob
    import uuid

    port = _free_port()
    token = uuid.uuid4().hex[:16]  # names the pair's shared-memory files, removed below
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS=str(max(threads, 1)),
               PIPEPLANNER_RUN_TOKEN=token)  # runtime.shm_files.RUN_TOKEN
    code = "from runtime.link_probe import main; main()"  # the run's transport, measured as a run has it
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(
        {"rank": r, "port": port, "threads": threads, "sizes": list(sizes), "repeats": repeats, "warmup": warmup,
         "timeout_s": timeout_s, "allreduce_sizes": list(ALLREDUCE_BYTES), "attempts": attempts,
         "rhythm": list(rhythm) if rhythm else None, "p2p": p2p,
         "allreduce_repeats": max(3, repeats // 3)})],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        for r in range(2)]
    outputs, errors = [], []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=attempts * timeout_s + 30)  # each try of the ping-pong its own time
            outputs.append(out)
            if proc.returncode != 0:
                errors.append((err.strip().splitlines() or ["?"])[-1])
        if errors:  # the cause, not the other process's finding that its peer is gone
            cause = next((e for e in errors if "is gone" not in e and "Timeout" not in e), errors[0])
            raise RuntimeError(f"measuring the link failed: {cause}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for path in glob.glob(f"/dev/shm/pipeplanner-{token}-*"):  # what a killed probe left (its rings' names)
            try:
                os.unlink(path)
            except OSError:
                pass
    return json.loads(outputs[0])
