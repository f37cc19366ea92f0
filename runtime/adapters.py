"""`runtime execute --save-adapters DIR`: a LoRA fine-tune's adapters alone, in peft's format.

The ranks save their stages' state as for `--save-state` (the whole model's state_dict under its
own names, frozen weights included); the launcher builds the plan's model once more, loads that
state into it and has peft write the adapters (planner.model.lora.save_adapters): DIR holds
adapter_config.json and the adapter weights, loadable by `peft.PeftModel.from_pretrained(base, DIR)`.
DIR is written whole or not at all (a sibling directory renamed into place).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Dict

from planner.errors import UsageError
from planner.plan.file import Plan


def check_adapters_target(plan: Plan, directory: str) -> None:
    """Before training: one line (UsageError) unless the plan's model has peft adapters and
    `directory` can receive them (absent or empty)."""
    from planner.model.lora import is_peft_model

    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise UsageError(f"--save-adapters {directory!r} exists and is not an empty directory; name a new one")
    from runtime.stage import plan_spec

    if not is_peft_model(plan_spec(plan, on_meta=True).module):
        raise UsageError(f"--save-adapters: the plan's model {plan.model.get('entry')} has no peft adapters; build "
                         "it with LoRA settings (e.g. --model-arg lora_rank=8) or save the whole state with "
                         "--save-state")


def write_adapters(plan: Plan, state: Dict[str, Any], directory: str) -> None:
    """The trained adapters of `state` (the whole model's state_dict) into `directory`, peft's format."""
    from planner.model.lora import save_adapters

    from runtime.stage import plan_spec

    module = plan_spec(plan).module
    module.load_state_dict(state)
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".adapters-", dir=parent)
    try:
        save_adapters(module, tmp)
        if os.path.isdir(directory):
            os.rmdir(directory)  # empty (checked before training)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
