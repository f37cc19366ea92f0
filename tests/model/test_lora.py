"""LoRA settings of `hf:` models (planner.model.lora): peft adapters on the named modules, the base
weights frozen; bad settings and --save-adapters without adapters are one line, exit code 2."""
import contextlib
import io
import os

import pytest

pytest.importorskip("peft")

from planner.cli.main import main as planner_main  # noqa: E402
from planner.model.entry import build_spec  # noqa: E402
from planner.model.spec import ModelEntryError  # noqa: E402
from planner.plan.file import save_plan  # noqa: E402
from runtime.cli import main as runtime_main  # noqa: E402
from tests.support.runs import plan_with, profile_of  # noqa: E402

LLAMA = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "seq_len": 8}


def _run(main, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue().strip()


def test_adapters_on_the_named_modules_and_the_rest_frozen():
    module = build_spec("hf:LlamaForCausalLM", dict(LLAMA, lora_rank=2, lora_targets="k_proj"), 0).module
    trained = [name for name, p in module.named_parameters() if p.requires_grad]
    assert len(trained) == 4 and all(".k_proj.lora_" in name for name in trained)
    default = build_spec("hf:LlamaForCausalLM", dict(LLAMA, lora_rank=2), 0).module  # peft's choice: q, v
    assert {name.split(".")[-4] for name, p in default.named_parameters() if p.requires_grad} == {"q_proj", "v_proj"}


@pytest.mark.parametrize("args,message", [
    ({"lora_rank": 4, "lora_targets": "q_proj,qproj"}, "lora_targets qproj names no module of the model; choose among"),
    ({"lora_alpha": 16}, "lora_alpha without lora_rank"),
    ({"lora_rank": 0}, "lora_rank=0 is not a positive integer"),
    ({"lora_rank": 4, "lora_alpha": "big"}, "lora_alpha='big' is not a positive number"),
])
def test_bad_settings_are_one_line(args, message):
    with pytest.raises(ModelEntryError, match=message):
        build_spec("hf:LlamaForCausalLM", dict(LLAMA, **args), 0)


def test_commands_refuse_bad_lora_settings_and_adapters_without_lora(tmp_path):
    small = [word for key, value in LLAMA.items() for word in ("--model-arg", f"{key}={value}")]
    code, err = _run(planner_main, ["profile", "hf:LlamaForCausalLM", *small, "--model-arg", "lora_rank=4",
                                    "--model-arg", "lora_targets=nope", "-o", str(tmp_path / "p.json")])
    assert code == 2 and err.startswith("error: hf:LlamaForCausalLM: lora_targets nope") and "\n" not in err
    assert not os.path.exists(tmp_path / "p.json")
    plan_path = str(tmp_path / "plan.json")
    save_plan(plan_with(profile_of("tests.models:tied_lm"), [2], 1, 2), plan_path)
    code, err = _run(runtime_main, ["execute", plan_path, "--save-adapters", str(tmp_path / "ad")])
    assert code == 2 and "has no peft adapters" in err and "\n" not in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    code, err = _run(runtime_main, ["execute", plan_path, "--save-adapters", str(tmp_path / "full")])
    assert code == 2 and "is not an empty directory" in err
