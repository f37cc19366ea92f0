"""How fast this CPU host computes right now: the median time of one fixed reference kernel.

A shared machine's speed drifts (other tenants' jobs, frequency): the same unit can take much
longer a minute later (BENCHMARKS.md). The profile times the reference kernel while it measures, and every rank of a
run times it before its first and after its last step, all ranks at once as the run's ranks load
the host's cores together (the profile's co-runners run the kernel meanwhile for the same
reason). The ratio tells a run that met another host speed from a wrong model: `runtime execute`
and `planner check` say so when it is off by more than `SLOWDOWN_WARN`; a profile whose own measurement
drifted that much is measured again (`steadiest_profile`).

CPU only: a GPU's speed does not drift that way, and its kernels are timed differently (None).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from planner.profile.profile import Profile

REFERENCE_KERNEL = "fp32 matmul 256x256 by 256x256 (median over calls)"
SLOWDOWN_WARN = 0.10  # beyond +-10 % the host ran at another speed than when profiled
_operands: Dict[str, Any] = {}


def reference_kernel_s(seconds: float = 0.1, device: Any = None) -> Optional[float]:
    """Median seconds of one reference-kernel call over `seconds` of calls (at least 5), on this
    thread's torch threads; None on anything but a CPU."""
    import torch  # here: the report and the launcher read this module without loading torch

    if device is not None and torch.device(device).type != "cpu":
        return None
    if not _operands:
        g = torch.Generator().manual_seed(0)
        _operands.update(a=torch.randn(256, 256, generator=g), b=torch.randn(256, 256, generator=g))
    a, b = _operands["a"], _operands["b"]
    torch.mm(a, b)  # first call: thread pool, caches
    times: List[float] = []
    end = time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mean_kernel_s(samples: Sequence[Optional[float]]) -> Optional[float]:
    values = [float(s) for s in samples if s]
    return statistics.mean(values) if values else None


def host_slowdown(profiled_s: Optional[float], rank_samples: Sequence[Sequence[Optional[float]]]) -> Optional[Dict[str, Any]]:
    """The run's host speed against the profile's: per rank, the mean of its samples (before and
    after its steps) over the profile's kernel time; `slowest` is the largest such ratio (the
    pipeline goes at its slowest rank's pace). None where either side did not measure."""
    if not profiled_s:
        return None
    ratios = [None if mean_kernel_s(s) is None else mean_kernel_s(s) / float(profiled_s) for s in rank_samples]
    known = [r for r in ratios if r is not None]
    if not known:
        return None
    return {"kernel": REFERENCE_KERNEL, "profiled_s": float(profiled_s), "per_rank": ratios, "slowest": max(known),
            "fastest": min(known)}


def worst_ratio(slowdown: Optional[Dict[str, Any]]) -> float:
    """The rank ratio furthest from 1 (1.0 where nothing was measured)."""
    if not slowdown:
        return 1.0
    return max((slowdown["slowest"], slowdown["fastest"]), key=lambda r: abs(r - 1.0))


def at_host_speed(predicted_s: float, slowdown: Optional[Dict[str, Any]]) -> Optional[float]:
    """The prediction scaled to the host speed the run met: predicted x the slowest rank's kernel
    ratio (a pipeline goes at its slowest rank's pace). It tells the host's drift from the model's
    error; it scales transfers too, which do not slow with the host: an estimate. None where the
    run or the profile did not time the kernel."""
    if not slowdown:
        return None
    return predicted_s * float(slowdown["slowest"])


def slowdown_warning(slowdown: Optional[Dict[str, Any]]) -> Optional[str]:
    """One line when the run met another host speed than the profile did, else None."""
    worst = worst_ratio(slowdown)
    if abs(worst - 1.0) <= SLOWDOWN_WARN:
        return None
    rank = slowdown["per_rank"].index(worst)
    how = "slower" if worst > 1 else "faster"
    return (f"the host computed at another speed than when profiled: the reference kernel took x{worst:.2f} the "
            f"profile's time on rank {rank} ({how}); measured times include that (a shared or throttled machine); "
            "re-profile when it is quiet, or calibrate")


def host_speed_lines(slowdown: Optional[Dict[str, Any]], predicted_s: Optional[float] = None,
                     measured_s: Optional[float] = None) -> List[str]:
    """What a report or a check prints of the host's speed: the ratio range, the plan's prediction
    at that speed against the measured iteration (when both are given), and the warning."""
    if not slowdown:
        return []
    lines = [f"host speed during the run: the reference kernel took x{slowdown['fastest']:.2f}.."
             f"x{slowdown['slowest']:.2f} of the profile's time on the ranks"]
    if predicted_s and measured_s:
        scaled = at_host_speed(predicted_s, slowdown)
        lines.append(f"at the run's host speed the plan predicts {scaled * 1e3:.2f} ms (x{slowdown['slowest']:.2f}): "
                     f"error {(measured_s - scaled) / scaled * 100:+.1f}%")
    warning = slowdown_warning(slowdown)
    return lines + (["warning: " + warning] if warning else [])


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
