"""LoRA fine-tuning through peft: a model's base weights frozen, small trainable adapters added.

`hf:` models take the settings as model arguments (planner.model.builtin.hf):

    lora_rank=R        the adapters' rank (no LoRA without it)
    lora_alpha=A       their scale is A / R (default A = R: scale 1)
    lora_targets=a,b   the names of the modules that get adapters (the last part of a module's name,
                       `q_proj`, `v_proj`; default: peft's choice for the model type)

Rules: the adapters' dropout is 0 (as every dropout of an `hf:` model: a pipeline trains exactly
like one process) and their bias is none; peft initialises them (B = 0: the wrapped model starts
equal to the base). The spec's module is then a `peft.PeftModel`: the planner and the runtime treat
it as any module whose frozen parameters have requires_grad=False. `save_adapters` writes the
adapters alone in peft's format.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional

import torch

from planner.model.spec import ModelEntryError

LORA_ARGS = ("lora_rank", "lora_alpha", "lora_targets")


def split_lora_args(args: Dict[str, Any]) -> Dict[str, Any]:
    """Take the LoRA settings out of `args` (in place) and return them."""
    return {key: args.pop(key) for key in LORA_ARGS if key in args}


def _peft():
    try:
        import peft
    except ImportError:
        raise ModelEntryError("LoRA settings (lora_rank=...) need peft: pip install peft") from None
    return peft


def _leaf_names(model: torch.nn.Module) -> List[str]:
    """The last parts of the names of the modules LoRA can wrap (linear, embedding, conv layers)."""
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)
    gpt2_conv = type(None)
    try:
        from transformers.pytorch_utils import Conv1D as gpt2_conv  # GPT-2's linear layers
    except ImportError:
        pass
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if name and isinstance(module, kinds + (gpt2_conv,))})


def _targets(raw: Any, model: torch.nn.Module, where: str) -> Optional[List[str]]:
    if raw is None:
        return None
    names = [part.strip() for part in str(raw).split(",") if part.strip()]
    known = _leaf_names(model)
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        raise ModelEntryError(f"{where}: lora_targets {', '.join(unknown) or repr(raw)} names no module of the model; "
                              f"choose among {', '.join(known)} (comma-separated)")
    return names


def add_lora(model: torch.nn.Module, settings: Dict[str, Any], where: str) -> torch.nn.Module:
    """The model with LoRA adapters per `settings` (the module docstring's arguments), as a
    peft.PeftModel in training mode; the model itself when `settings` is empty."""
    if not settings:
        return model
    rank = settings.get("lora_rank")
    if rank is None:
        raise ModelEntryError(f"{where}: {', '.join(settings)} without lora_rank; add --model-arg lora_rank=8 "
                              "(the adapters' rank)")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ModelEntryError(f"{where}: lora_rank={rank!r} is not a positive integer (e.g. lora_rank=8)")
    alpha = settings.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ModelEntryError(f"{where}: lora_alpha={alpha!r} is not a positive number (e.g. lora_alpha=16)")
    targets = _targets(settings.get("lora_targets"), model, where)
    peft = _peft()
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    try:
        with warnings.catch_warnings():  # transformers' deprecation notes on what peft calls: not the user's
            warnings.simplefilter("ignore", FutureWarning)
            wrapped = peft.get_peft_model(model, config)
    except ValueError as e:  # no default targets known for this model type, say
        raise ModelEntryError(f"{where}: peft cannot add LoRA adapters: {str(e).splitlines()[0]}; name the modules "
                              f"with --model-arg lora_targets=... (among {', '.join(_leaf_names(model))})") from None
    wrapped.train()
    return wrapped


def is_peft_model(module: torch.nn.Module) -> bool:
    try:
        import peft
    except ImportError:
        return False
    return isinstance(module, peft.PeftModel)


def save_adapters(module: torch.nn.Module, directory: str) -> None:
    """Write the adapters of a peft model in peft's format (adapter_config.json and the weights),
    loadable by `peft.PeftModel.from_pretrained(base_model, directory)`."""
    if not is_peft_model(module):
        raise ValueError("the model has no peft adapters to save (build it with LoRA settings, e.g. "
                         "--model-arg lora_rank=8)")
    os.makedirs(directory, exist_ok=True)
    module.save_pretrained(directory)
