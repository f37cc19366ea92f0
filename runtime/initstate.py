"""Starting a run from saved weights (`--init-state PATH`) with only this rank's stages in memory.

The model is built with its parameters on the meta device (no storage; buffers, which are small
and may be computed at construction, such as rotary frequencies, stay real), moved wholly to meta
and captured there (torch.export runs on a meta example batch). After the rank's stages are cut
out, `materialise` gives their parameters and buffers real storage on the rank's device, read
from the file: a rank's memory is its stages, never the model.

PATH is a `state_dict` file (`.pt`/`.pth`/`.bin`, read with `torch.load(weights_only=True,
mmap=True)`: nothing is unpickled and only the entries read are paged in; `.safetensors`), or a
Hugging Face `save_pretrained` directory (`model.safetensors` or its shards, else
`pytorch_model*.bin`). Keys are the model's `state_dict` names, as `runtime execute --save-state`
writes them, so a run's merged state can start a run under another plan.
"""
from __future__ import annotations

import glob
import os
from typing import Callable, Dict, List, Mapping, Tuple

import torch
from torch import nn


class InitStateError(ValueError):
    """The state file cannot start this model: missing, unreadable, or not matching it."""


class InitState:
    """The tensors of a state file by name, read when asked for."""

    def __init__(self, path: str):
        self.path = path
        self._readers: Dict[str, Callable[[], torch.Tensor]] = {}
        if os.path.isdir(path):
            files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) or \
                sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
            if not files:
                raise InitStateError(f"--init-state {path!r}: a directory without *.safetensors or pytorch_model*.bin; "
                                     "give a save_pretrained directory or a state_dict file")
        elif os.path.isfile(path):
            files = [path]
        elif os.path.exists(path):
            raise InitStateError(f"--init-state {path!r} is not a regular file; give a state_dict file or a "
                                 "save_pretrained directory")
        else:
            raise InitStateError(f"--init-state {path!r} does not exist")
        for file in files:
            self._open(file)
        if not self._readers:
            raise InitStateError(f"--init-state {path!r} holds no tensors")

    def _open(self, file: str) -> None:
        if file.endswith(".safetensors"):
            try:
                from safetensors import safe_open

                handle = safe_open(file, framework="pt")
                for key in handle.keys():
                    self._readers[key] = (lambda h=handle, k=key: h.get_tensor(k))
            except Exception as e:  # safetensors raises its own types for a bad header
                raise InitStateError(f"--init-state {file!r} is not a readable safetensors file: {e}") from None
            return
        try:
            state = torch.load(file, weights_only=True, mmap=True, map_location="cpu")
        except Exception as e:  # a pickle with other objects, a truncated or non-torch file
            if "weights only load failed" in str(e).lower():  # (torch's text advises weights_only=False: never here)
                raise InitStateError(f"--init-state {file!r} holds Python objects besides tensors, which the runtime "
                                     "never unpickles; save the state_dict alone: torch.save(model.state_dict(), "
                                     "PATH)") from None
            raise InitStateError(f"--init-state {file!r} is not a state_dict saved with torch.save ("
                                 f"{type(e).__name__}); save one with torch.save(model.state_dict(), PATH)") from None
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise InitStateError(f"--init-state {file!r} is not a state_dict (a dict of tensors by name)")
        for key, value in state.items():
            self._readers[key] = (lambda v=value: v)

    def __contains__(self, key: str) -> bool:
        return key in self._readers

    def keys(self) -> List[str]:
        return list(self._readers)

    def get(self, key: str) -> torch.Tensor:
        return self._readers[key]()


def model_names(model: nn.Module) -> Dict[int, str]:
    """Each parameter's and buffer's tensor (by id) -> its first name in the model."""
    names: Dict[int, str] = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), name)
    return names


def unused_note(state: InitState, model: nn.Module) -> str:
    """What the run says of the file's entries the model does not name (a checkpoint of another model,
    a renamed layer): they are not loaded, so a run that only looks right is not taken for one from
    the file. "" where every entry is the model's."""
    named = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    named |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    unused = [key for key in state.keys() if key not in named]
    if not unused:
        return ""
    shown = ", ".join(repr(k) for k in unused[:3]) + (", ..." if len(unused) > 3 else "")
    return (f"warning: --init-state {state.path!r}: {len(unused)} of its {len(state.keys())} entries are not this "
            f"model's ({shown}) and were not loaded")


def materialise(modules: List[nn.Module], others: List[nn.Module], names: Mapping[int, str], state: InitState,
                buffers: Mapping[str, torch.Tensor], device: torch.device) -> None:
    """Give every meta tensor of `modules` its value on `device`: from `state` under its model name,
    or (buffers only) from `buffers`. A tensor held under several names or by several modules
    stays one tensor; `others` (the model itself, say) get the same new tensors where they share them."""
    made: Dict[int, torch.Tensor] = {}
    replaced: List[torch.Tensor] = []  # the meta tensors, alive while their ids key `made`

    def value_of(tensor: torch.Tensor, is_param: bool) -> torch.Tensor:
        name = names.get(id(tensor))
        if name is None:
            raise InitStateError("a stage holds a tensor the model does not name; re-run `planner profile`")
        if name in state:
            loaded = state.get(name)
        elif not is_param and name in buffers:
            loaded = buffers[name]
        else:
            raise InitStateError(f"--init-state {state.path!r} has no entry {name!r}; give the state_dict of this "
                                 "model (the names of `model.state_dict()`)")
        if tuple(loaded.shape) != tuple(tensor.shape):
            raise InitStateError(f"--init-state {state.path!r}: {name!r} has shape {tuple(loaded.shape)}, the model "
                                 f"{tuple(tensor.shape)}; give the state_dict of this model")
        if loaded.device.type == "meta":
            raise InitStateError(f"--init-state {state.path!r}: {name!r} is a meta tensor (no values); save the "
                                 "state_dict of a model with its weights")
        if loaded.dtype != tensor.dtype and (loaded.is_complex() != tensor.is_complex() or
                                             loaded.is_floating_point() != tensor.is_floating_point()):
            raise InitStateError(f"--init-state {state.path!r}: {name!r} is {str(loaded.dtype).replace('torch.', '')}, "
                                 f"the model {str(tensor.dtype).replace('torch.', '')}; give the state_dict of this "
                                 "model")
        if loaded.dtype != tensor.dtype:  # another precision of the same kind (bf16 weights for fp32): cast
            loaded = loaded.to(tensor.dtype)
        if device.type == "cpu" and loaded.is_contiguous():
            return loaded  # a file-mapped tensor: its pages become the rank's (copied on first write)
        return loaded.to(device, copy=True).contiguous()

    for module in modules:
        for sub in module.modules():
            for kind in ("_parameters", "_buffers"):
                slots = getattr(sub, kind)
                for key, tensor in list(slots.items()):
                    if tensor is None or tensor.device.type != "meta":
                        continue
                    if id(tensor) not in made:
                        replaced.append(tensor)
                        value = value_of(tensor, kind == "_parameters")
                        made[id(tensor)] = nn.Parameter(value, requires_grad=tensor.requires_grad) \
                            if kind == "_parameters" else value
                    slots[key] = made[id(tensor)]
    old_ids = set(made)
    for module in others:
        for sub in module.modules():
            for kind in ("_parameters", "_buffers"):
                slots = getattr(sub, kind)
                for key, tensor in list(slots.items()):
                    if tensor is not None and id(tensor) in old_ids:
                        slots[key] = made[id(tensor)]


def meta_example(batch: Tuple) -> Tuple:
    """An example batch's inputs on meta (torch.export of a meta model)."""
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to("meta")
        if isinstance(value, (tuple, list)):
            return type(value)(move(v) for v in value)
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        return value
    return move(batch)


def release(roots: List[nn.Module], tensors: set) -> None:
    """Replace the parameters and buffers whose ids are in `tensors` by storage-less meta tensors
    wherever `roots` hold them: the stages of other ranks, which every rank built but need not keep."""
    meta: Dict[int, torch.Tensor] = {}
    for root in roots:
        for sub in root.modules():
            for kind in ("_parameters", "_buffers"):
                slots = getattr(sub, kind)
                for key, tensor in list(slots.items()):
                    if tensor is None or id(tensor) not in tensors:
                        continue
                    if id(tensor) not in meta:
                        moved = tensor.detach().to("meta")
                        meta[id(tensor)] = (nn.Parameter(moved, requires_grad=tensor.requires_grad)
                                            if kind == "_parameters" else moved)
                    slots[key] = meta[id(tensor)]
