"""A cluster as levels (devices in hosts in sites): `planner solve --topology topo.json` (issue 22).

JSON schema::

    {
      "levels": [
        {"name": "site",   "count": 2, "bandwidth": "100MB", "latency": 0.02, "emulate": true},
        {"name": "host",   "count": 1, "bandwidth": "10GB",  "latency": 1e-5},
        {"name": "device", "count": 2}
      ],
      "device": {"memory": "16GiB", "speed": 1.0},
      "devices": {"3": {"speed": 0.5}}
    }

- levels, outermost first: `count` (int >= 1) of this level inside each one of the level above
  (the first: in the whole cluster). The cluster has the product of the counts devices, numbered
  in that nesting (device index = mixed-radix number of its position at each level, the outermost
  most significant). A level's `bandwidth` (bytes/s, a number or a size such as "100MB") and
  `latency` (seconds) are those of the link between two devices whose positions first differ at
  that level: the link of the highest level where they differ. Omitted: the solve's --bandwidth
  and --latency for pipeline messages, its --dp-bandwidth for the data-parallel exchange (the
  innermost level usually omits them: its link is what `planner profile` measured).
  `"emulate": true` marks a level whose link the runtime emulates on one machine
  (runtime/emulation.py): messages and exchanges crossing it are held for their planned time.
- device: every device's `memory` (bytes or a size; default --memory-per-device) and `speed`
  (relative to the profiled device; default 1).
- devices (optional): overrides by device index ("0" .. N - 1): `memory` and/or `speed`.

Unknown keys are refused (a typo would otherwise be ignored). Placement of stages and replicas on
the devices: planner.cost.placement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from planner.jsonio import read_json, refuse_unknown_keys
from planner.sizes import bandwidth_value, latency_value, size_value, speed_value


@dataclass(frozen=True)
class Level:
    name: str
    count: int
    bandwidth: Optional[float] = None  # bytes/s of the link between devices differing first here; None: default
    latency: Optional[float] = None  # seconds; None: default
    emulate: bool = False  # the runtime emulates this level's link


@dataclass(frozen=True)
class Device:
    memory: Optional[float] = None  # bytes; None: the global cap
    speed: float = 1.0


@dataclass(frozen=True)
class DeviceTopology:
    levels: Tuple[Level, ...]
    devices: Tuple[Device, ...]  # by device index

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def position(self, device: int) -> Tuple[int, ...]:
        """The device's index at each level, outermost first."""
        out = []
        for level in reversed(self.levels):
            out.append(device % level.count)
            device //= level.count
        return tuple(reversed(out))

    def level_between(self, a: int, b: int) -> Optional[int]:
        """The index of the highest (outermost) level where devices a and b differ; None if a == b."""
        for index, (x, y) in enumerate(zip(self.position(a), self.position(b))):
            if x != y:
                return index
        return None

    def link(self, a: int, b: int, bandwidth: float, latency: float) -> Tuple[float, float]:
        """(bandwidth, latency) between devices a and b; the defaults where the level gives none
        (and between a device and itself: the innermost level's)."""
        index = self.level_between(a, b)
        level = self.levels[-1 if index is None else index]
        return (bandwidth if level.bandwidth is None else level.bandwidth,
                latency if level.latency is None else level.latency)

    def emulated(self, a: int, b: int) -> bool:
        index = self.level_between(a, b)
        return index is not None and self.levels[index].emulate


_LEVEL_KEYS = {"name", "count", "bandwidth", "latency", "emulate"}
_DEVICE_KEYS = {"memory", "speed"}




def _device(d: Any, where: str, base: Device) -> Device:
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object with \"memory\" and/or \"speed\"")
    refuse_unknown_keys(d, _DEVICE_KEYS, where)
    memory = base.memory if "memory" not in d else size_value(d["memory"], f"{where} memory")
    speed = base.speed if "speed" not in d else speed_value(d["speed"], f"{where} speed")
    return Device(memory=memory, speed=speed)


def topology_from_json(d: Any) -> DeviceTopology:
    """Validate and convert the JSON object; a one-line ValueError on bad input."""
    if not isinstance(d, dict) or not isinstance(d.get("levels"), list) or not d["levels"]:
        raise ValueError("topology file needs a non-empty \"levels\" list (outermost first, e.g. site, host, device)")
    refuse_unknown_keys(d, {"levels", "device", "devices"}, "topology file")
    levels: List[Level] = []
    for i, raw in enumerate(d["levels"]):
        where = f"level {i}"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object with \"count\"")
        refuse_unknown_keys(raw, _LEVEL_KEYS, where)
        count = raw.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"{where} needs \"count\": a positive integer (got {count!r})")
        emulate = raw.get("emulate", False)
        if not isinstance(emulate, bool):
            raise ValueError(f"{where} \"emulate\" must be true or false (got {emulate!r})")
        name = raw.get("name", f"level{i}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where} \"name\" must be a non-empty string (got {name!r})")
        levels.append(Level(
            name=name, count=count,
            bandwidth=None if raw.get("bandwidth") is None else bandwidth_value(raw["bandwidth"], f"{where} bandwidth"),
            latency=None if raw.get("latency") is None else latency_value(raw["latency"], f"{where} latency"),
            emulate=emulate))
    names = [level.name for level in levels]
    if len(set(names)) != len(names):
        raise ValueError(f"topology levels need distinct names (got {names})")
    total = 1
    for level in levels:
        total *= level.count
    if total > 4096:
        raise ValueError(f"the topology has {total} devices; at most 4096 are supported")
    base = _device(d.get("device", {}), "\"device\"", Device())
    devices = [base] * total
    overrides = d.get("devices", {})
    if not isinstance(overrides, dict):
        raise ValueError("\"devices\" must be an object of overrides by device index, e.g. {\"3\": {\"speed\": 0.5}}")
    for key, raw in overrides.items():
        if not key.isdigit() or not int(key) < total:
            raise ValueError(f"\"devices\" key {key!r} is not a device index 0..{total - 1}")
        devices[int(key)] = _device(raw, f"device {key}", base)
    return DeviceTopology(levels=tuple(levels), devices=tuple(devices))


def load_topology(path: str) -> DeviceTopology:
    return topology_from_json(read_json(path, what="topology"))
