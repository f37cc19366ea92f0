"""Coverage across architectures: each model goes through the three commands as a user runs them
(`planner profile`, `planner solve` for 2 and 4 stages, `runtime execute --save-state`, 3 steps)
and its saved state (parameters and buffers) is compared with single-process training on the
same micro-batches (tests/pipeline.reference_state).

    .venv/bin/python benchmarks/coverage.py [--only gpt2,resnet] [--global-batch 8] [--json out.json]

Models are tiny configurations with random weights (Hugging Face models from their config
classes, nothing downloaded); profiles are short (1 timed round, no warm-up, sizes 1 and 2),
since the question is whether the plan runs exactly, not how fast. A row is exact when the
largest difference over every parameter and buffer is at most 1e-5 (fp32). Prints a Markdown
table (BENCHMARKS.md keeps the last run's).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.runs import run_cli  # noqa: E402

_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, seq_len=8)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
               patch_size=4)
# name -> (entry, model arguments, what it is); profiled at micro-batch sizes 1 and 2, except where
# SIZES says otherwise (LLaVA: torch.export fixes its batch size at 2, planner/capture_export.py)
SIZES = {"llava": "2"}
MODELS: Dict[str, Tuple[str, Dict[str, Any], str]] = {
    "gpt2": ("hf:GPT2LMHeadModel", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=32, seq_len=8),
             "GPT-2, tied embedding and LM head"),
    "llama": ("hf:LlamaForCausalLM", _TEXT, "Llama (RoPE, grouped-query attention)"),
    "qwen2": ("hf:Qwen2ForCausalLM", _TEXT, "Qwen2"),
    "mixtral": ("hf:MixtralForCausalLM", dict(_TEXT, num_local_experts=4, num_experts_per_tok=2),
                "Mixtral (mixture of experts, 4 experts, top-2)"),
    "bert": ("hf:BertForMaskedLM", dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=16, seq_len=8),
             "BERT, masked LM"),
    "t5": ("hf:T5ForConditionalGeneration", dict(vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_layers=2,
                                                  num_decoder_layers=2, num_heads=4, tie_word_embeddings=False,
                                                  seq_len=8), "T5, encoder-decoder"),
    "llava": ("hf:LlavaForConditionalGeneration",
              dict({f"text_config__{k}": v for k, v in _TEXT.items() if k != "seq_len"},
                   **{f"vision_config__{k}": v for k, v in _VISION.items()}, vision_config__projection_dim=32,
                   seq_len=8), "LLaVA: CLIP vision tower + projector + Llama, image and text"),
    "vit": ("hf:ViTForImageClassification", dict(_VISION, num_labels=10), "ViT, image classification"),
    "resnet": ("builtin:resnet", dict(batchnorm=True, inplace=True),
               "ResNet, torchvision-style: BatchNorm, ReLU(inplace=True), out += identity"),
    "mobilenet": ("builtin:mobilenet", dict(blocks=3, image=16),
                  "MobileNetV3-style: inverted residuals, in-place Hardswish/ReLU, squeeze-excitation"),
    "unet": ("builtin:unet", dict(depth=2, width=4, image=16), "U-Net: skip concatenations across many units"),
}
STEPS, LR, EXACT = 3, 0.05, 1e-5


def _run(args: List[str]) -> str:
    result = run_cli(args, timeout=None)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return result.stdout


def _model_args(args: Dict[str, Any]) -> List[str]:
    return [a for k, v in args.items() for a in ("--model-arg", f"{k}={v}")]


def profile_command(entry: str, model_args: Dict[str, Any], sizes: str, path: str) -> List[str]:
    """`planner profile` of a model, short (one timed round, no warm-up, no link measurement)."""
    return ["planner.cli", "profile", entry, *_model_args(model_args), "--micro-batch-sizes", sizes, "--repeats",
            "1", "--min-time", "0", "--warmup", "0", "--retries", "0", "--link", "none", "--quiet", "-o", path]


def worst_entries(state: Dict[str, Any], reference: Dict[str, Any], n: int = 3) -> List[str]:
    """The n entries of a saved state furthest from the reference, beyond EXACT ("name diff")."""
    from tests.support.runs import max_abs_diff

    worst = sorted(((max_abs_diff({k: state[k]}, {k: reference[k]}), k) for k in reference), reverse=True)
    return [f"{k} {d:.1e}" for d, k in worst[:n] if d > EXACT]


def cover(name: str, global_batch: int, tmp: str) -> Dict[str, Any]:
    """One row: profile, then solve and execute on 2 and 4 stages, each compared with one process."""
    import torch

    from planner.plan.file import load_plan
    from planner.profile.profile import load_profile
    from tests.support.runs import max_abs_diff, reference_state

    entry, model_args, what = MODELS[name]
    profile_path = os.path.join(tmp, f"{name}.json")
    start = time.perf_counter()
    out = _run(profile_command(entry, model_args, SIZES.get(name, "1,2"), profile_path))
    wall = time.perf_counter() - start
    profile = load_profile(profile_path)
    seconds = re.search(r"in ([0-9.]+) s$", out.strip())
    row: Dict[str, Any] = {"name": name, "entry": entry, "what": what, "capture": profile.capture,
                           "units": profile.num_units, "profile_s": float(seconds.group(1)) if seconds else wall}
    row["merged"] = sum(len(m["absorbed"]) for m in profile.extra.get("inplace_merges", []))
    for stages in (2, 4):
        plan_path, state_path = os.path.join(tmp, f"{name}-{stages}.plan.json"), os.path.join(tmp, f"{name}.pt")
        _run(["planner.cli", "solve", profile_path, "--stages", str(stages), "--global-batch", str(global_batch),
              "--schedule", "1f1b", "-o", plan_path])
        plan = load_plan(plan_path)
        _run(["runtime.cli", "execute", plan_path, "--steps", str(STEPS), "--lr", str(LR), "--save-state", state_path])
        state = torch.load(state_path, weights_only=True)
        reference = reference_state(plan, steps=STEPS, lr=LR)
        diff = max_abs_diff(state, reference)
        row[f"inexact_{stages}"] = worst_entries(state, reference)
        cuts = [s.first_unit for s in plan.stages[1:]]
        row[f"plan_{stages}"] = (f"{plan.schedule} {plan.micro_batch_size}x{plan.num_micro_batches}, "
                                 f"cuts {','.join(map(str, cuts))}")
        row[f"diff_{stages}"] = diff
    return row


def table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| model | what | capture | units | profile s | plan, 2 stages | max diff | plan, 4 stages | max diff |",
             "|---|---|---|---:|---:|---|---:|---|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['what']} | | | | {r['error']} | | | |")
            continue
        cells = [f"{r['diff_' + str(s)]:.1e}" + ("" if r["diff_" + str(s)] <= EXACT else " **not exact**")
                 for s in (2, 4)]
        units = f"{r['units']}" + (f" ({r['merged']} in-place joined)" if r["merged"] else "")
        lines.append(f"| `{r['entry']}` | {r['what']} | {r['capture']} | {units} | {r['profile_s']:.1f} | "
                     f"{r['plan_2']} | {cells[0]} | {r['plan_4']} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--global-batch", type=int, default=8, help="samples per step (default 8)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                rows.append(cover(name, args.global_batch, tmp))
            except RuntimeError as e:
                rows.append({"name": name, "what": MODELS[name][2], "error": str(e)})
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
