"""The captured graph against the model's own forward, on the example batch.

A capture is a trace of one run of forward's Python; library code may take another path while it
is traced. transformers builds an explicit causal mask under torch.export where eager sdpa, with no
padding, passes none and reads the module's `is_causal` (PaliGemma sets it False: eager attends to
later tokens, the graph does not); code may branch on `torch.compiler.is_exporting()` or on fx's
tracing. Every stage would then train another model than one process does, silently. So the
measured profile runs both on its first batch, from the same random state and buffers, and
refuses a graph whose output differs by more than rounding (`check_same_output`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from planner.errors import CaptureError
from planner.model.trace_state import PythonState

TOLERANCE = 1e-4  # relative to the output's largest value: fp32 kernels in another order stay far below


def _tensors(output: Any) -> Dict[str, torch.Tensor]:
    """The output's tensors by where they sit in it (`['logits']`, `[0]`, `.a`)."""
    leaves = pytree.tree_flatten_with_path(output)[0]
    return {pytree.keystr(path): leaf for path, leaf in leaves if isinstance(leaf, torch.Tensor)}


def _lined_up(expected: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor]) -> List[Tuple[str, Any, Any]]:
    """(where, forward's, the graph's) for the tensors both return at one place (fx returns a ModelOutput
    as a plain dict, keyed alike); by position where the places differ but the counts agree; else none."""
    common = [key for key in expected if key in got]
    if common:
        return [(f"output{key}" if key else "output", expected[key], got[key]) for key in common]
    if len(expected) == len(got):
        return [(f"output {index}", e, g) for index, (e, g) in enumerate(zip(expected.values(), got.values()))]
    return []


def _buffers(*modules: nn.Module) -> Dict[int, torch.Tensor]:
    return {id(b): b for m in modules for b in m.buffers()}


def check_same_output(module: nn.Module, graph: nn.Module, eager, traced, seed: int = 0) -> None:
    """Run `eager()` (the model's forward) and `traced()` (the graph's) from one random state and the
    same buffers, with no autograd; CaptureError where an output differs beyond `TOLERANCE`. The
    model's buffers, plain attributes and the random generators are as before afterwards."""
    buffers = _buffers(module, graph)
    kept = {key: b.detach().clone() for key, b in buffers.items()}
    state = PythonState(module)
    outputs = []
    devices = sorted({b.device for b in buffers.values() if b.device.type == "cuda"}, key=str)
    try:
        for run in (traced, eager):  # the graph first: where it fails, the caller names the node
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(seed)
                try:
                    outputs.append({key: t if t.device.type == "meta" else t.detach().cpu()
                                    for key, t in _tensors(run()).items()})
                except Exception:
                    if run is traced:
                        raise
                    return  # forward itself cannot run this batch (BatchNorm on one sample): nothing to compare
                finally:
                    for key, b in buffers.items():
                        b.data.copy_(kept[key])
    finally:
        state.put_back()
    got, expected = outputs
    for where, e, g in _lined_up(expected, got):
        if e.shape != g.shape:
            _refuse(f"its {where} has shape {tuple(g.shape)}, forward's {tuple(e.shape)}")
        if e.device.type == "meta":
            continue
        if not (e.is_floating_point() or e.is_complex()):
            if not torch.equal(e, g):
                _refuse(f"its {where} differs from forward's")
            continue
        if not e.numel():
            continue
        wide = torch.complex128 if e.is_complex() else torch.float64
        e, g = e.to(wide), g.to(wide)
        apart = torch.where(torch.isnan(e) & torch.isnan(g), 0.0, (e - g).abs())  # NaN where both have it
        scale, diff = float(torch.nan_to_num(e.abs()).max()), float(apart.max())
        if not diff <= TOLERANCE * scale + 1e-6:  # a NaN where forward has none fails too
            _refuse(f"its {where} differs from forward's by {diff:.3g} (forward's largest value {scale:.3g})")


def _refuse(what: str) -> None:
    raise CaptureError(
        f"the captured graph does not compute what the model's forward does on the example batch: {what}. The "
        "trace took another path through forward's code (library code that builds masks or picks kernels "
        "differently while traced, a branch on torch.compiler.is_exporting()), so every stage would train another "
        "model; for an hf: model try --model-arg attn_implementation=eager, else make that code path the same "
        "when traced")
