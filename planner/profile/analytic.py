"""Analytic profiles: plan for hardware that is not at hand.

The model is built and captured on the meta device (shapes and dtypes, no parameter memory),
and every unit runs forward and backward there under a dispatch mode that counts, per ATen
operation, its FLOPs (`torch.utils.flop_counter`'s formulas) and the bytes it reads and writes
(tensor arguments and results; views move nothing). A device spec turns each operation into a
time with the roofline `max(flops / peak, bytes / bandwidth) / efficiency`. Memory (parameters,
saved activations, values crossing cuts) comes from shapes and dtypes, as in a measured profile.

Device specs are JSON files (`profiles/devices/h100.json` ...; a user may pass a path):
`{"name", "peak_flops": {"bfloat16": FLOP/s, "float32": ...}, "memory_bandwidth": B/s,
"efficiency": 0..1, "memory_bytes": B}`. `cpu-calibrated` is measured on the fly with a matmul
and a copy micro-benchmark, to check the analytic model against real measurements here.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from planner.jsonio import JsonFileError, read_json

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
DEVICES_DIR = os.path.join(_ROOT, "profiles", "devices")


class DeviceSpecError(ValueError):
    """The device spec cannot be found or read. The message says how to fix it."""


@dataclass
class DeviceSpec:
    """What the roofline needs of a device."""

    name: str
    peak_flops: Dict[str, float]  # dtype name -> FLOP/s (dense)
    memory_bandwidth: float  # bytes/s
    efficiency: float = 1.0  # fraction of the roofline real kernels reach
    memory_bytes: int = 0
    op_overhead_s: float = 0.0  # fixed cost per operation (kernel launch / eager dispatch)
    notes: str = ""

    def peak(self, dtype: str) -> float:
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if "float32" in self.peak_flops:
            return self.peak_flops["float32"]
        raise DeviceSpecError(f"device spec {self.name!r} has no peak_flops for {dtype}; add it to the file")

    def op_seconds(self, flops: float, bytes_moved: float, dtype: str) -> float:
        roofline = max(flops / self.peak(dtype), bytes_moved / self.memory_bandwidth) / self.efficiency
        return roofline + self.op_overhead_s


def load_device_spec(name_or_path: str, threads: int = 1) -> DeviceSpec:
    """A shipped spec by name (a100, h100, h200), a JSON path, or `cpu-calibrated` (measured now)."""
    if name_or_path == "cpu-calibrated":
        return calibrate_cpu(threads)
    path = name_or_path if os.path.exists(name_or_path) else os.path.join(DEVICES_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        shipped = sorted(f[:-5] for f in os.listdir(DEVICES_DIR) if f.endswith(".json"))
        raise DeviceSpecError(f"no device spec {name_or_path!r}: use one of {', '.join(shipped)}, cpu-calibrated, "
                              "or a path to a JSON file like profiles/devices/h100.json")
    try:
        d = read_json(path, what="device spec")
    except JsonFileError as e:
        raise DeviceSpecError(str(e)) from None
    try:
        spec = DeviceSpec(name=d["name"], peak_flops={k: float(v) for k, v in d["peak_flops"].items()},
                          memory_bandwidth=float(d["memory_bandwidth"]), efficiency=float(d.get("efficiency", 1.0)),
                          memory_bytes=int(d.get("memory_bytes", 0)),
                          op_overhead_s=float(d.get("op_overhead_s", 0.0)), notes=d.get("notes", ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as e:
        raise DeviceSpecError(f"device spec {path} is malformed ({type(e).__name__}: {e}); it needs name, "
                              "peak_flops {dtype: FLOP/s}, memory_bandwidth (B/s), efficiency") from None
    rates = list(spec.peak_flops.values()) + [spec.memory_bandwidth]
    # (a device slower than a kilo-operation per second makes times no profile can hold: MAX_SECONDS)
    if not all(1e3 <= x < math.inf for x in rates) or not 0 < spec.efficiency <= 1 or \
            not 0 <= spec.op_overhead_s <= 1.0 or spec.memory_bytes < 0:
        raise DeviceSpecError(f"device spec {path}: peak_flops and memory_bandwidth must be finite and at least 1e3, "
                              "efficiency in (0, 1], op_overhead_s 0..1 s and memory_bytes >= 0")
    return spec


def calibrate_cpu(threads: int = 1, size: int = 512, copy_mib: int = 64) -> DeviceSpec:
    """Peak FLOP/s from a fp32 matmul and bandwidth from a large copy, with `threads` threads."""
    if threads > 0:
        torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    src = torch.empty(copy_mib * 2**20 // 4)
    dst = torch.empty_like(src)

    def best(fn, repeats: int = 7) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    matmul_s = best(lambda: torch.mm(a, b))
    copy_s = best(lambda: dst.copy_(src))
    overhead_s = _per_op_overhead(best)
    flops = 2 * size ** 3 / matmul_s
    return DeviceSpec(name="cpu-calibrated", peak_flops={"float32": flops, "bfloat16": flops, "float16": flops},
                      memory_bandwidth=2 * src.numel() * 4 / copy_s, efficiency=1.0, op_overhead_s=overhead_s,
                      notes=f"{threads} thread(s): {size}^3 fp32 matmul, {copy_mib} MiB copy, tiny MLP step per op")


def _per_op_overhead(best) -> float:
    """Seconds per ATen op of a forward+backward on tiny tensors: eager dispatch and autograd."""
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(16)])
    x = torch.randn(2, 4)

    def step():
        net(x).sum().backward()

    with CostCounter(DeviceSpec("count", {"float32": 1.0}, 1.0)) as counter:
        step()
    return best(step) / counter.costs.ops


@dataclass
class OpCosts:
    """FLOPs, bytes and roofline seconds of the operations run under a `CostCounter`."""

    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0
    ops: int = 0
    by_op: Dict[str, float] = field(default_factory=dict)  # seconds per op name (for inspection)


def _bytes(values: Any) -> int:
    leaves, _ = tree_flatten(values)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _dtype_of(args: Any) -> str:
    leaves, _ = tree_flatten(args)
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return str(t.dtype).replace("torch.", "")
    return "float32"


class CostCounter(TorchDispatchMode):
    """Counts each ATen op's FLOPs and bytes moved, and its roofline time on `device`."""

    def __init__(self, device: DeviceSpec):
        super().__init__()
        self.device = device
        self.costs = OpCosts()

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def add(self, flops: float, moved: float, dtype: str, name: str) -> None:
        """Count one operation's FLOPs and bytes and its roofline time."""
        seconds = self.device.op_seconds(flops, moved, dtype)
        c = self.costs
        c.flops, c.bytes, c.seconds = c.flops + flops, c.bytes + moved, c.seconds + seconds
        c.by_op[name] = c.by_op.get(name, 0.0) + seconds

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        moved = 0 if func.is_view or packet in _FREE else _bytes((args, kwargs)) + _bytes(out)
        self.costs.ops += 1
        if flops or moved:
            self.add(flops, moved, _dtype_of(args), str(packet).split(".")[-1])
        return out


_ACTIVE: List[CostCounter] = []  # the counters entered, innermost last


def charge(flops: float, moved: float, dtype: torch.dtype, name: str = "attention") -> None:
    """Count an operation the dispatcher does not see (a kernel costed by formula, e.g.
    planner.profile.attention) on the innermost active CostCounter, as one operation."""
    if _ACTIVE:
        _ACTIVE[-1].costs.ops += 1
        _ACTIVE[-1].add(flops, moved, str(dtype).replace("torch.", ""), name)


# Metadata-only ops: no memory traffic (views are detected by `is_view`).
_FREE = {torch.ops.aten.detach, torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_numel,
         torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided, torch.ops.aten.lift_fresh}


def device_spec_json(spec: DeviceSpec) -> Dict[str, Any]:
    return asdict(spec)


def saved_key(tensor: torch.Tensor) -> Optional[int]:
    """A storage identity that also works for meta tensors (whose data_ptr is 0)."""
    storage = tensor.untyped_storage()
    return storage._cdata if tensor.device.type == "meta" else storage.data_ptr()
