"""Where each (data-parallel replica, pipeline rank) runs on a leveled topology, and what the cost
model sees of it (issue 22).

A placement of p pipeline ranks x d replicas on the N = p d devices of a DeviceTopology
(planner.cost.topology_file) is `devices[replica][rank]`, a device index each, every device once.

The cost model costs one replica's lists and all replicas run them in step, so it sees, per
pipeline rank i and pair of ranks, the slowest of the replicas (exact when the replicas are placed
alike, as the ones the search keeps usually are):

    speed(i)       min over replicas of the device's speed
    memory(i)      min over replicas of the device's memory
    path(i, j)     the link between devices[r][i] and devices[r][j] (the highest level where they
                   differ): the lowest bandwidth and the highest latency over replicas r
    exchange(i)    the data-parallel exchange of rank i's gradients over its d holders
                   G_i = {devices[r][i]}, hierarchical (below)

Hierarchical exchange. A flat exchange over n holders at bandwidth B costs (n - 1)/n K / B
(planner.cost.memory: K bytes per parameter byte, by shard). Over a group G whose members first
differ at level l, split there into s parts of k devices each: reduce-scatter inside each part,
exchange a 1/k share across the s parts over level l's link, all-gather inside:

    h(G) = h(part) + (s - 1)/s / (k B_l)          (h(one device) = 0; h per unit K)

so a group inside one site exchanges at the site's inner links only, and one spread over sites
sends 1/k of the bytes across. Unequal parts: the slowest part and the smallest k (a bound). The
cost model charges the bytes as a flat exchange over d at the effective bandwidth
(d - 1)/d / h(G_i), which is exactly h(G_i) K, plus the rings' latency once per step (whenever
d > 1 and the rank exchanges any bytes: one holding only frozen parameters runs no collective,
planner.cost.exchange.reduce_time; under ZeRO-3 one ring's, lat(G) / 2, per gather and reduce-scatter):

    lat(G) = lat(part) + 2 (s - 1) latency_l       (a reduce-scatter and an all-gather ring of s steps)

`emulated_exchange(i, seconds)` is the part of rank i's planned exchange spent on emulated links:
what the runtime holds after its own (loopback) exchange.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from planner.cost.topology_file import DeviceTopology
from planner.pipeline.topology import is_placement, launcher_order

MAX_SEARCHED_DEVICES = 8  # the search enumerates N! / d! placements


@dataclass(frozen=True)
class Placement:
    topology: DeviceTopology
    devices: Tuple[Tuple[int, ...], ...]  # [replica][pipeline rank] -> device index

    @property
    def data_parallel(self) -> int:
        return len(self.devices)

    @property
    def pipeline_ranks(self) -> int:
        return len(self.devices[0])

    def validate(self) -> None:
        n, d = self.topology.num_devices, len(self.devices)
        p = len(self.devices[0]) if self.devices else 0
        if p * d != n or not is_placement(self.devices, p, d):
            raise ValueError(f"a placement must use each of the topology's {n} devices once, as d rows of p "
                             f"(got {[list(row) for row in self.devices]})")

    def speed(self, i: int) -> float:
        return min(self.topology.devices[row[i]].speed for row in self.devices)

    def memory(self, i: int, default: Optional[float]) -> Optional[float]:
        caps = [self.topology.devices[row[i]].memory for row in self.devices]
        caps = [default if cap is None else cap for cap in caps]
        return None if all(cap is None for cap in caps) else min(cap for cap in caps if cap is not None)

    def path(self, i: int, j: int, bandwidth: float, latency: float) -> Tuple[float, float]:
        links = [self.topology.link(row[i], row[j], bandwidth, latency) for row in self.devices]
        return min(bw for bw, _ in links), max(lat for _, lat in links)

    def emulated(self, i: int, j: int) -> bool:
        return any(self.topology.emulated(row[i], row[j]) for row in self.devices)

    def holders(self, i: int) -> Tuple[int, ...]:
        return tuple(sorted(row[i] for row in self.devices))

    def exchange_bandwidth(self, i: Optional[int], bandwidth: float) -> float:
        """The effective bandwidth of rank i's hierarchical exchange (module docstring); `bandwidth`
        for the levels that give none. Rank None: the fastest rank's (a solver's bound stays a bound)."""
        d = self.data_parallel
        if d == 1:
            return bandwidth
        ranks = range(self.pipeline_ranks) if i is None else [i]
        h = min(_hierarchical(self.topology, self.holders(r), bandwidth, 0.0).seconds for r in ranks)
        return (d - 1) / d / h if h > 0 else math.inf

    def exchange_latency(self, i: int, latency: float) -> float:
        """Seconds of latency of rank i's exchange per step (`latency` for levels that give none)."""
        if self.data_parallel == 1:
            return 0.0
        return _hierarchical(self.topology, self.holders(i), 1.0, latency).latency

    def emulated_exchange(self, i: int, seconds: float, latency: float, rings: float = 2.0) -> float:
        """Of `seconds`, rank i's planned exchange (its latency included, `latency` the default),
        the seconds spent on emulated links; `rings`: how many rings' latency (half of lat(G) each) it
        holds -- an all-reduce's two, or ZeRO-3's one per collective."""
        if self.data_parallel == 1 or seconds <= 0:  # no exchange planned (nothing to exchange): none held
            return 0.0
        x = _hierarchical(self.topology, self.holders(i), 1.0, latency)
        share = x.emulated_seconds / x.seconds if x.seconds > 0 else 0.0
        return max(0.0, seconds - rings / 2 * x.latency) * share + rings / 2 * x.emulated_latency

    def signature(self) -> Tuple:
        """Everything the cost model reads of the placement, as level indices and devices: two
        placements with the same signature cost the same (the search keeps one of them)."""
        p, topo = self.pipeline_ranks, self.topology
        devices = tuple(tuple(sorted((topo.devices[row[i]].speed, topo.devices[row[i]].memory or 0.0)
                                     for row in self.devices)) for i in range(p))
        pairs = tuple(tuple(sorted(_level_key(topo.level_between(row[i], row[j])) for row in self.devices))
                      for i in range(p) for j in range(i + 1, p))
        exchanges = tuple(_shape(topo, self.holders(i)) for i in range(p))
        return devices, pairs, exchanges


def _level_key(level: Optional[int]) -> int:
    return -1 if level is None else level


def _split(topology: DeviceTopology, group: Sequence[int]) -> Tuple[Optional[int], List[Tuple[int, ...]]]:
    """(the highest level where members differ, the parts by their position there)."""
    level = min((topology.level_between(group[0], other) for other in group[1:]
                 if topology.level_between(group[0], other) is not None), default=None)
    if level is None:
        return None, [tuple(group)]
    parts: Dict[int, List[int]] = {}
    for dev in group:
        parts.setdefault(topology.position(dev)[level], []).append(dev)
    return level, [tuple(part) for _, part in sorted(parts.items())]


@dataclass(frozen=True)
class _Exchange:
    seconds: float = 0.0  # h(G): seconds per unit K
    emulated_seconds: float = 0.0  # of them, over emulated links
    latency: float = 0.0  # lat(G)
    emulated_latency: float = 0.0


@functools.lru_cache(maxsize=4096)  # a placement's exchanges are asked for on every evaluation
def _hierarchical(topology: DeviceTopology, group: Tuple[int, ...], bandwidth: float, latency: float) -> _Exchange:
    """h(G) and lat(G) (module docstring), and their parts over emulated links."""
    if len(group) <= 1:
        return _Exchange()
    level, parts = _split(topology, group)
    inner = max((_hierarchical(topology, part, bandwidth, latency) for part in parts),
                key=lambda x: (x.seconds, x.latency))
    s, k = len(parts), min(len(part) for part in parts)
    link = topology.levels[level]
    cross = (s - 1) / s / (k * (bandwidth if link.bandwidth is None else link.bandwidth))
    wait = 2 * (s - 1) * (latency if link.latency is None else link.latency)
    return _Exchange(inner.seconds + cross, inner.emulated_seconds + (cross if link.emulate else 0.0),
                     inner.latency + wait, inner.emulated_latency + (wait if link.emulate else 0.0))


def _shape(topology: DeviceTopology, group: Sequence[int]) -> Tuple:
    if len(group) <= 1:
        return ()
    level, parts = _split(topology, group)
    return level, tuple(sorted(_shape(topology, part) + (len(part),) for part in parts))


def identity_placement(topology: DeviceTopology, pipeline_ranks: int, data_parallel: int) -> Placement:
    """Replica r, rank i on device r p + i: the launcher's order."""
    return Placement(topology, launcher_order(pipeline_ranks, data_parallel))


def placements(topology: DeviceTopology, pipeline_ranks: int, data_parallel: int) -> List[Placement]:
    """Every placement of p ranks x d replicas on the topology's devices, one per signature (the
    first found in lexicographic order, so the launcher's order wins ties). ValueError beyond
    MAX_SEARCHED_DEVICES devices."""
    return list(_placements(topology, pipeline_ranks, data_parallel))


@functools.lru_cache(maxsize=32)  # a solve and each of planner compare's baselines ask for the same ones
def _placements(topology: DeviceTopology, pipeline_ranks: int, data_parallel: int) -> Tuple[Placement, ...]:
    n, p, d = topology.num_devices, pipeline_ranks, data_parallel
    if p * d != n:
        raise ValueError(f"{p} pipeline ranks x {d} replicas do not fill the topology's {n} devices")
    if n > MAX_SEARCHED_DEVICES:
        raise ValueError(f"the placement search enumerates placements of at most {MAX_SEARCHED_DEVICES} devices; "
                         f"the topology has {n}")
    seen: Dict[Tuple, Placement] = {}
    for order in _orders(n, p, d):
        placement = Placement(topology, order)
        seen.setdefault(placement.signature(), placement)
    return tuple(seen.values())


def _orders(n: int, p: int, d: int) -> Iterator[Tuple[Tuple[int, ...], ...]]:
    """Device orders as d rows of p, replicas in the order of their rank-0 devices (replicas are
    interchangeable)."""
    for perm in itertools.permutations(range(n)):
        rows = tuple(perm[r * p:(r + 1) * p] for r in range(d))
        if all(rows[r][0] < rows[r + 1][0] for r in range(d - 1)):
            yield rows
