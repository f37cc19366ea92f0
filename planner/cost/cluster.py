"""A heterogeneous cluster: device groups with their own memory and speed, and the links between them.

JSON schema (`--cluster cluster.json`)::

    {
      "groups": [
        {"name": "dc1", "devices": 2, "memory": "16GiB", "speed": 1.0,
         "bandwidth": "10GB", "latency": 0.0},
        {"name": "dc2", "devices": 2, "memory": 17179869184, "speed": 0.5}
      ],
      "links": [{"bandwidth": "100MB", "latency": 0.01, "emulate": true}]
    }

- groups, in pipeline order: `devices` (int >= 1), `memory` (bytes per device, a number or a
  size such as "16GiB"; optional, default: --memory-per-device), `speed` (relative to the
  profiled device; a unit's time is divided by it; default 1), `bandwidth`/`latency` between two
  devices of the group (default: --bandwidth / --latency).
- links: exactly len(groups) - 1 entries; links[i] joins group i and group i + 1. `"emulate": true`
  marks a link the runtime emulates on one machine: the plan lists the stage boundaries whose
  messages cross it (`emulated_boundaries`), and `runtime execute` holds both ends of each such
  message for its planned transfer time after the message has crossed (runtime/engine.py), so a
  slow link's plan can be checked here against its prediction.

Pipeline rank r runs on the r-th device counting through the groups in order, so the cluster
must hold exactly `--stages` devices. A transfer between ranks i < j in different groups pays the
slowest link on the way (min bandwidth) and the sum of the link latencies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from planner.jsonio import read_json, refuse_unknown_keys
from planner.sizes import bandwidth_value, latency_value, size_value, speed_value


@dataclass(frozen=True)
class DeviceGroup:
    name: str
    devices: int
    memory: Optional[float] = None  # bytes per device; None = the global cap
    speed: float = 1.0
    bandwidth: Optional[float] = None  # bytes/s inside the group; None = the global bandwidth
    latency: Optional[float] = None


@dataclass(frozen=True)
class Link:
    bandwidth: float
    latency: float = 0.0
    emulate: bool = False  # the runtime emulates this link (a delay per message crossing it)


@dataclass(frozen=True)
class Cluster:
    groups: Tuple[DeviceGroup, ...]
    links: Tuple[Link, ...]

    @property
    def num_devices(self) -> int:
        return sum(g.devices for g in self.groups)

    def group_of(self, device: int) -> int:
        """Index of the group holding pipeline rank `device`."""
        for index, group in enumerate(self.groups):
            if device < group.devices:
                return index
            device -= group.devices
        raise ValueError(f"device {device} is beyond the cluster's {self.num_devices} devices")

    def speed(self, device: int) -> float:
        return self.groups[self.group_of(device)].speed

    def memory(self, device: int, default: Optional[float]) -> Optional[float]:
        value = self.groups[self.group_of(device)].memory
        return default if value is None else value

    def path(self, i: int, j: int, bandwidth: float, latency: float) -> Tuple[float, float]:
        """(bandwidth, latency) between ranks i and j: the group's own, or the links crossed."""
        gi, gj = sorted((self.group_of(i), self.group_of(j)))
        if gi == gj:
            g = self.groups[gi]
            return (bandwidth if g.bandwidth is None else g.bandwidth), (latency if g.latency is None else g.latency)
        crossed = self.links[gi:gj]
        return min(link.bandwidth for link in crossed), sum(link.latency for link in crossed)

    def emulated(self, i: int, j: int) -> bool:
        """Whether a message between ranks i and j crosses a link the runtime emulates."""
        gi, gj = sorted((self.group_of(i), self.group_of(j)))
        return any(link.emulate for link in self.links[gi:gj])


def cluster_from_json(d: Any) -> Cluster:
    """Validate and convert the JSON object; one-line ValueError on bad input."""
    if not isinstance(d, dict) or not isinstance(d.get("groups"), list) or not d["groups"]:
        raise ValueError("cluster file needs a non-empty \"groups\" list")
    refuse_unknown_keys(d, ("groups", "links"), "cluster file")
    groups: List[DeviceGroup] = []
    for i, g in enumerate(d["groups"]):
        if not isinstance(g, dict) or not isinstance(g.get("devices"), int) or isinstance(g["devices"], bool) \
                or g["devices"] < 1:
            raise ValueError(f"cluster group {i} needs \"devices\": a positive integer")
        refuse_unknown_keys(g, ("name", "devices", "memory", "speed", "bandwidth", "latency"), f"cluster group {i}")
        speed = speed_value(g.get("speed", 1.0), f"cluster group {i} speed")
        latency = g.get("latency")
        if latency is not None:
            latency = latency_value(latency, f"cluster group {i} latency")
        name = g.get("name", f"group{i}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"cluster group {i} \"name\" must be a non-empty string (got {name!r})")
        groups.append(DeviceGroup(
            name=name, devices=g["devices"],
            memory=None if g.get("memory") is None else size_value(g["memory"], f"group {i} memory"),
            speed=speed,
            bandwidth=None if g.get("bandwidth") is None else bandwidth_value(g["bandwidth"], f"group {i} bandwidth"),
            latency=latency))
    links_json = d.get("links", [])
    if not isinstance(links_json, list) or len(links_json) != len(groups) - 1:
        raise ValueError(f"cluster file needs {len(groups) - 1} links (one between consecutive groups), "
                         f"got {len(links_json) if isinstance(links_json, list) else links_json!r}")
    links = []
    for i, link in enumerate(links_json):
        if not isinstance(link, dict) or "bandwidth" not in link:
            raise ValueError(f"cluster link {i} needs \"bandwidth\"")
        refuse_unknown_keys(link, ("bandwidth", "latency", "emulate"), f"cluster link {i}")
        latency = latency_value(link.get("latency", 0.0), f"cluster link {i} latency")
        emulate = link.get("emulate", False)
        if not isinstance(emulate, bool):
            raise ValueError(f"cluster link {i} \"emulate\" must be true or false (got {emulate!r})")
        links.append(Link(bandwidth=bandwidth_value(link["bandwidth"], f"link {i} bandwidth"), latency=latency,
                          emulate=emulate))
    return Cluster(groups=tuple(groups), links=tuple(links))


def load_cluster(path: str) -> Cluster:
    return cluster_from_json(read_json(path, what="cluster"))
