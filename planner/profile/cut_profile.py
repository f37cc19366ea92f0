"""CutValue and CutProfile: the values crossing each cut of a profile, tensors with their shapes
and bytes or constants, per micro-batch size.

Cut k (1 <= k < L) is the boundary just before unit k; the values crossing it are those produced
before unit k and consumed at or after it (skip connections included). Model inputs are never counted
as crossing: every rank rebuilds the batch itself from the deterministic `batch` function.

A tensor keeps the order its dimensions lie in memory (`order`, outermost first; recorded where it is
not the shapes' own, e.g. a channels-last activation): the runtime sends and receives it in that order,
so the next stage computes on what the profile timed it on (oneDNN picks its kernels by layout: a
depthwise convolution of a channels-last input received as NCHW ran ~100x slower, BENCHMARKS.md).
Its gradient travels back in the order the model's backward lays it out (`grad_order`, recorded where
that is not the value's own: a batch-first LSTM hands its input's gradient back time-major), so the
stage before holds between a split backward's parts what the profile measured, as inside one stage
(a Linear on a transposed value keeps its bias's gradient and a contiguous copy of it where that
gradient arrives transposed, one storage where it arrives in the value's order; BENCHMARKS.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from planner.profile.reader import Reader, show, str_keys

# the dtypes a value crossing a cut may have: those runtime.comm sends
MESSAGE_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
                  "complex64", "complex128", "complex32")


@dataclass
class CutValue:
    """A value crossing a cut: a tensor (sent point-to-point) or a constant (e.g. a size).

    Constants depend only on the micro-batch size, so the runtime injects them instead of
    sending them.
    """

    name: str
    kind: str  # "tensor" | "constant"
    dtype: Optional[str] = None
    requires_grad: bool = False
    shape: Dict[int, List[int]] = field(default_factory=dict)
    bytes: Dict[int, int] = field(default_factory=dict)
    value: Dict[int, Any] = field(default_factory=dict)
    order: Dict[int, List[int]] = field(default_factory=dict)  # where not the shape's own (dense_order)
    grad_order: Dict[int, List[int]] = field(default_factory=dict)  # the gradient's, where not `order`'s

    def to_json(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "tensor":
            d.update(dtype=self.dtype, requires_grad=self.requires_grad,
                     shape=str_keys(self.shape), bytes=str_keys(self.bytes))
            if self.order:
                d["order"] = str_keys(self.order)
            if self.grad_order:
                d["grad_order"] = str_keys(self.grad_order)
        else:
            d["value"] = str_keys(self.value)
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any], read: "Reader", where: str) -> "CutValue":
        d = read.table(d, where)
        kind = d.get("kind")
        if kind not in ("tensor", "constant"):
            raise read.error(f"{where}.kind", f"is {show(kind)}: expected \"tensor\" or \"constant\"")

        def shape(value: Any, at: str) -> List[int]:
            if not isinstance(value, list):
                raise read.error(at, f"is {show(value)}: expected a list of sizes")
            return [read.count(n, f"{at}[{i}]") for i, n in enumerate(value)]

        tensor = kind == "tensor"

        def order(value: Any, at: str) -> List[int]:
            if not is_dim_order(value, len(value) if isinstance(value, list) else 0):
                raise read.error(at, f"is {show(value)}: expected the tensor's dimensions in memory order, "
                                     "a permutation of 0 .. its rank - 1")
            return value

        name, dtype, grad = d.get("name", ""), d.get("dtype"), d.get("requires_grad", False)
        if not (isinstance(name, str) and name):
            raise read.error(f"{where}.name", f"is {show(name)}: expected the value's name")
        if tensor and dtype not in MESSAGE_DTYPES:
            raise read.error(f"{where}.dtype", f"is {show(dtype)}: expected one of {', '.join(MESSAGE_DTYPES)}")
        if not isinstance(grad, bool):
            raise read.error(f"{where}.requires_grad", f"is {show(grad)}: expected true or false")
        value = cls(
            name=name,
            kind=kind,
            dtype=dtype,
            requires_grad=grad,
            shape=read.per_size(d.get("shape", {}), f"{where}.shape", shape, required=tensor),
            bytes=read.per_size(d.get("bytes", {}), f"{where}.bytes", read.count, required=tensor),
            value=read.per_size(d.get("value", {}), f"{where}.value", lambda v, _: v, required=not tensor),
            order=read.per_size(d.get("order", {}), f"{where}.order", order, required=False),
            grad_order=read.per_size(d.get("grad_order", {}), f"{where}.grad_order", order, required=False),
        )
        for field_name, orders in (("order", value.order), ("grad_order", value.grad_order)):
            for b, dims in orders.items():
                if len(dims) != len(value.shape.get(b, ())):
                    raise read.error(f'{where}.{field_name}["{b}"]', f"is {show(dims)}: not one entry per dimension "
                                                                     f"of its shape {show(value.shape.get(b))}")
        return value

    def at(self, micro_batch_size: int) -> Dict[str, Any]:
        """This value's description at one micro-batch size (what a plan's stage carries)."""
        b = micro_batch_size
        if self.kind == "tensor":
            out = {"name": self.name, "kind": "tensor", "dtype": self.dtype,
                   "requires_grad": self.requires_grad, "shape": self.shape[b], "bytes": self.bytes[b]}
            if b in self.order:
                out["order"] = self.order[b]
            if b in self.grad_order:
                out["grad_order"] = self.grad_order[b]
            return out
        return {"name": self.name, "kind": "constant", "value": self.value[b]}


def is_dim_order(value: Any, ndim: int) -> bool:
    """Whether `value` is a tensor's dimensions in memory order: a permutation of 0 .. ndim - 1 (integers)."""
    return (isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in value)
            and sorted(value) == list(range(ndim)))


def dense_order(tensor: Any) -> Optional[List[int]]:
    """The order a dense tensor's dimensions lie in memory (outermost first) where it is not the
    shape's own (e.g. [0, 2, 3, 1] for a channels-last image batch); None where it is, or where the
    tensor is not dense in any order (a slice: it travels contiguous)."""
    if tensor.is_contiguous() or tensor.dim() < 2:
        return None
    strides = tensor.stride()
    order = sorted(range(tensor.dim()), key=lambda d: (-strides[d], d))
    return order if tensor.permute(order).is_contiguous() else None


def shape_in_order(shape: Sequence[int], order: Optional[Sequence[int]]) -> Tuple[int, ...]:
    """The shape with its dimensions in memory order (`order`, outermost first; None: the shape's own)."""
    return tuple(shape) if order is None else tuple(shape[d] for d in order)


def to_order(tensor: Any, order: Optional[Sequence[int]]) -> Any:
    """The tensor with its dimensions permuted into `order` (a view; contiguous where it lies so)."""
    return tensor if order is None else tensor.permute(tuple(order))


def from_order(buffer: Any, order: Optional[Sequence[int]]) -> Any:
    """What a buffer in memory order `order` holds: a view with the strides the tensor had (`to_order`'s inverse)."""
    return buffer if order is None else buffer.permute(sorted(range(len(order)), key=list(order).__getitem__))


@dataclass
class CutProfile:
    """Cut k: the boundary before unit k."""

    before_unit: int
    values: List[CutValue]

    def activation_bytes(self, b: int) -> int:
        """Bytes sent forward across this cut for one micro-batch of size b."""
        return sum(v.bytes[b] for v in self.values if v.kind == "tensor")

    def gradient_bytes(self, b: int) -> int:
        """Bytes of gradients sent backward across this cut for one micro-batch of size b."""
        return sum(v.bytes[b] for v in self.values if v.kind == "tensor" and v.requires_grad)

    def to_json(self) -> Dict[str, Any]:
        return {"before_unit": self.before_unit, "values": [v.to_json() for v in self.values]}

    @classmethod
    def from_json(cls, d: Dict[str, Any], read: "Reader", where: str, k: int) -> "CutProfile":
        """Cut k, the k-th entry of the file's cuts (before unit k)."""
        d = read.table(d, where)
        if d.get("before_unit") != k or isinstance(d.get("before_unit"), bool):
            raise read.error(f"{where}.before_unit", f"is {show(d.get('before_unit'))}: cuts are listed in "
                             f"order, the k-th before unit k (expected {k})")
        values = d.get("values")
        if not isinstance(values, list):
            raise read.error(f"{where}.values", "is missing: expected the list of values crossing the cut")
        return cls(before_unit=k, values=[CutValue.from_json(v, read, f"{where}.values[{i}]")
                                          for i, v in enumerate(values)])
