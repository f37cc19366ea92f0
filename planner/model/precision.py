"""bf16-mixed: one bf16 compute copy of the weights per step, fp32 master weights and gradients.

The model's own parameters stay fp32: they are the master weights, the optimizer's parameters, what
checkpoints and `--save-state` write under the model's names and what `--init-state` loads. At the
start of a step `ComputeCopy.install` casts each weight to bf16 once (a differentiable cast,
`master.to(bfloat16)`) and puts the copy where the parameter sits in the stage modules; every
forward and backward of the step's micro-batches uses that one copy (torch.autocast around the
forward casts a bf16 tensor to bf16 for free, and caches nothing for a tensor that is not a leaf).
Each micro-batch's backward produces the bf16 gradient of the copy, and the cast's backward turns
it into fp32 and accumulates it into the master's `.grad` at once (autograd's AccumulateGrad): fp32
gradient accumulation, the bf16 gradient freed as soon as it is added. So every gradient path of the
runtime (data-parallel buckets, ZeRO-2's hand-over, tied-weight sums, clipping) sees fp32 master
gradients, exactly as in fp32 training. `remove` puts the masters back before the optimizer step.

Why a copy made at the step's start, not bf16 parameters kept between steps: the copy then exists
only while forwards and backwards run (not during the optimizer step, whose temporaries it would
add to, nor in checkpoints), it costs the same one cast per weight per step, and nothing outside
the step ever sees a parameter that is not the model's own.

A weight tied across places (an embedding and an LM head) gets a copy per place it sits in (a
module attribute): the runtime's stage modules are cut from the captured graph and keep the model's
layers, each holding the weights it reads, so the gradients of the two uses reach the master in
fp32 and are summed there, whether the uses are in one stage, in two stages of one rank or on two
ranks (then summed by the tie's all-reduce); one process training the model as written (its two
attributes) does the same. The cost: a tied weight is copied once per use.

Which parameters get a copy: floating-point ones of two or more dimensions (the weights of linear,
convolution and embedding layers: the matrices autocast runs in bf16, and the embedding tables, so
the residual stream starts in bf16 as in Megatron-LM). One-dimensional ones (biases, normalisation
scales and shifts) stay fp32 as torch.autocast treats them: normalisations run in fp32 with them
(BatchNorm needs its weights in its running statistics' dtype), and a bias autocast casts for a
matrix product is not saved for backward. Those are a negligible share of a model's bytes.

Custom operators (`torch.library.custom_op`, outside aten: transformers' MoE experts call
`transformers::grouped_mm_fallback`) are opaque to autocast. The model's code casts their input to
its weights' dtype itself (`input.to(weight.dtype)`), but the graph was captured with fp32 weights,
where that cast is nothing and is not recorded; so, under bf16-mixed, each custom operator in a
stage's graph gets autocast's rule (`torch.library.register_autocast`: floating inputs cast to the
compute dtype), which is what the model's cast does with the bf16 copy in one process. Not capture's own
`planner::autograd_function` (a custom autograd Function kept whole): it runs the Function under autocast on
its inputs as they come, as one process does.

Writing one tensor into another where both must have one dtype (`masked_scatter`, `index_put`,
`index_copy`, `index_add`, `scatter` and their kin, with a tensor source) has the same trouble:
LLaVA casts its image features to the text embeddings' dtype before scattering them in
(`features.to(embeds.dtype)`), a cast the fp32 capture did not record, so under bf16-mixed a bf16
embedding met fp32 features and the run stopped. Each such write in a stage's graph casts its
source to its destination's dtype (`match_written_dtypes`), as that line of the model does in one
process (nothing where they agree).

Both rules came first; an exported graph now takes the run's casts and kernels itself
(planner.model.casts), and they stay for what that leaves: a graph whose second export fails, and
graphs traced by torch.fx that call such operators.
"""
from __future__ import annotations

from typing import List, Sequence, Set, Tuple

import torch
from torch import nn


def gets_compute_copy(param: torch.Tensor) -> bool:
    """Whether bf16-mixed computes with a bf16 copy of this parameter (module docstring)."""
    return param.is_floating_point() and param.dim() >= 2


_AUTOCAST_REGISTERED: Set[str] = set()  # custom operators given autocast's rule in this process


def autocast_custom_ops(modules: Sequence[nn.Module], dtype: torch.dtype) -> None:
    """Give every custom operator (namespace other than aten and prims) called in the graphs of
    `modules` autocast's rule, floating inputs cast to `dtype` (module docstring), once per process."""
    for module in modules:
        for graph_module in module.modules():
            if not isinstance(graph_module, torch.fx.GraphModule):
                continue
            for node in graph_module.graph.nodes:
                op = node.target
                if node.op == "call_function" and isinstance(op, torch._ops.OpOverload) and \
                        op.namespace not in ("aten", "prims", "planner"):
                    name = op._schema.name
                    if name not in _AUTOCAST_REGISTERED:
                        for device_type in ("cpu", "cuda"):
                            torch.library.register_autocast(name, device_type, dtype)
                        _AUTOCAST_REGISTERED.add(name)


# writes of a source tensor into a destination that must share its dtype: op name -> the source's
# position and keyword (the destination is the first argument); the in-place forms too
_WRITES = {"masked_scatter": (2, "source"), "index_put": (2, "values"), "_index_put_impl": (2, "values"),
           "_unsafe_index_put": (2, "values"), "index_copy": (3, "source"), "index_add": (3, "source"),
           "index_reduce": (3, "source"), "scatter": (3, "src"), "scatter_add": (3, "src"),
           "scatter_reduce": (3, "src")}
_TORCH_WRITES = {getattr(torch, name): name for name in _WRITES if callable(getattr(torch, name, None))}


def _as_dtype_of(source, destination):
    """`source` in `destination`'s dtype where both are floating tensors of different dtypes (an
    integer destination keeps its refusal: a cast there would truncate), else itself."""
    if isinstance(source, torch.Tensor) and isinstance(destination, torch.Tensor) and \
            source.is_floating_point() and destination.is_floating_point() and source.dtype != destination.dtype:
        return source.to(destination.dtype)
    return source


def _written_source(node: torch.fx.Node):
    """(position, keyword) of the source `node` writes into its first argument (_WRITES), or None:
    aten operators (captured by torch.export), Tensor methods and torch functions (torch.fx)."""
    target = node.target
    if node.op == "call_method":
        name = target
    elif node.op != "call_function":
        return None
    elif isinstance(target, torch._ops.OpOverload):
        name = target._schema.name if target.namespace == "aten" else ""
    elif isinstance(target, torch._ops.OpOverloadPacket):
        namespace, _, name = target._qualified_op_name.partition("::")
        name = name if namespace == "aten" else ""
    else:
        name = _TORCH_WRITES.get(target, "") if callable(target) else ""
    name = name.split("::")[-1]
    return _WRITES.get(name) or (_WRITES.get(name[:-1]) if name.endswith("_") else None)  # in place too


def match_written_dtypes(modules: Sequence[nn.Module]) -> int:
    """Cast the source of every write in the graphs of `modules` that needs one dtype to its
    destination's (module docstring); how many writes were given the cast."""
    count = 0
    for module in modules:
        for graph_module in module.modules():
            if not isinstance(graph_module, torch.fx.GraphModule):
                continue
            changed = False
            for node in list(graph_module.graph.nodes):
                where = _written_source(node)
                if where is None or not node.args:
                    continue
                position, keyword = where
                source = node.args[position] if len(node.args) > position else node.kwargs.get(keyword)
                if not isinstance(source, torch.fx.Node) or source.target is _as_dtype_of:
                    continue  # a number, or given the cast already (a module passed twice)
                with graph_module.graph.inserting_before(node):
                    cast = graph_module.graph.call_function(_as_dtype_of, (source, node.args[0]))
                if len(node.args) > position:
                    node.update_arg(position, cast)
                else:
                    node.update_kwarg(keyword, cast)
                changed, count = True, count + 1
            if changed:
                graph_module.recompile()
    return count


class ComputeCopy:
    """The step's compute copies of the weights of `modules` (module docstring)."""

    def __init__(self, modules: Sequence[nn.Module], dtype: torch.dtype):
        self.dtype = dtype
        # every place a copied parameter sits: (owning module, attribute name, master); each
        # place gets its own copy (a tied weight: one per place, see the module docstring)
        self.slots: List[Tuple[nn.Module, str, nn.Parameter]] = []
        seen = set()
        for module in modules:
            for owner in module.modules():
                for name, param in owner._parameters.items():
                    if param is not None and gets_compute_copy(param) and (id(owner), name) not in seen:
                        seen.add((id(owner), name))
                        self.slots.append((owner, name, param))
        autocast_custom_ops(modules, dtype)
        match_written_dtypes(modules)

    def install(self) -> List[torch.Tensor]:
        """Cast each place's master once and put the copy there; the copies (held until `remove`
        and the last backward using them)."""
        with torch.enable_grad():
            # not register_parameter: the copy is not a leaf, and only for this step
            copies = [master.to(self.dtype) for _, _, master in self.slots]  # an edge to the master
        for (owner, name, _), copy in zip(self.slots, copies):
            owner._parameters[name] = copy
        return copies

    def remove(self) -> None:
        """Put the masters back (the optimizer steps them); idempotent."""
        for owner, name, master in self.slots:
            owner._parameters[name] = master
