"""Exactness sweep: models x planner / runtime options, each through the three commands as a user
runs them (`planner profile`, `planner solve` with the option, `runtime execute --save-state`), the
saved state (every parameter and buffer) compared with single-process training on the same
micro-batches (tests/support/runs.reference_state).

    .venv/bin/python benchmarks/sweep.py [--only gpt2,resnet] [--options gpipe,zb-v] [--json out.json]

One option at a time over the models (not their product): each row of OPTIONS is the baseline
(`--stages 2 --schedule 1f1b`, global batch 8, 3 steps of SGD at lr 0.05) with one thing changed.
Models are coverage.py's tiny configurations plus the builtin mlp and gpt and a LoRA Llama (frozen
base weights). A cell is

    exact            largest difference at most 1e-5 (bf16-mixed: against one bf16-mixed process)
    NOT EXACT        larger: the names that differ most follow
    refused: ...     a command stopped in one line with exit status 2 (correct behaviour; recorded)
    FAILED: ...      anything else: a traceback, another exit status, a hang (TIMEOUT s)

With data parallelism (d > 1) each replica's buffers follow its own micro-batches and the saved
state is replica 0's (tests/runtime/test_buffers.py), so the reference is replica 0's buffers.
Prints a Markdown table (BENCHMARKS.md, "Coverage across architectures", keeps the last run's).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.coverage import MODELS as COVERED, SIZES, profile_command, worst_entries  # noqa: E402
from tests.support.runs import run_cli  # noqa: E402

_LLAMA = COVERED["llama"][1]
MODELS: Dict[str, Tuple[str, Dict[str, Any], str]] = {
    "mlp": ("builtin:mlp", {}, "MLP"),
    "gpt": ("builtin:gpt", dict(vocab=128, dim=32, layers=2, heads=4, seq_len=8), "GPT (builtin)"),
    **{k: COVERED[k] for k in ("resnet", "mobilenet", "unet", "gpt2", "mixtral", "t5", "llava", "bert")},
    "llama-lora": ("hf:LlamaForCausalLM", dict(_LLAMA, lora_rank=4, lora_alpha=8, lora_targets="q_proj,v_proj"),
                   "Llama with LoRA adapters (base frozen)"),
}
# option -> (profile sizes, or None for the model's default; solve arguments; execute arguments;
# single-process reference's arguments: optimizer, training options). The baseline's values are
# replaced by the row's.
BASE_SOLVE = ["--stages", "2", "--schedule", "1f1b", "--global-batch", "8"]
OPTIONS: Dict[str, Tuple[Optional[str], List[str], List[str], Dict[str, Any]]] = {
    "1f1b": (None, [], [], {}),
    "gpipe": (None, ["--schedule", "gpipe"], [], {}),
    "interleaved": (None, ["--schedule", "interleaved", "--virtual-stages", "2"], [], {}),
    "bfs": (None, ["--schedule", "bfs", "--virtual-stages", "2"], [], {}),
    "zb-h1": (None, ["--schedule", "zb-h1"], [], {}),
    "zb-v": (None, ["--schedule", "zb-v"], [], {}),
    "recompute-all": (None, ["--recompute", "all"], [], {}),
    "3-stages": (None, ["--stages", "3"], [], {}),
    "devices-4": (None, ["--devices", "4"], [], {}),
    "zero-1": (None, ["--devices", "4", "--shard", "optimizer"], [], {}),
    "zero-2": (None, ["--devices", "4", "--shard", "gradients"], [], {}),
    "zero-3": (None, ["--devices", "4", "--shard", "parameters"], [], {}),
    "bf16-mixed": (None, ["--precision", "bf16-mixed"], [], {"training": {"precision": "bf16-mixed"}}),
    "b=1": ("1", [], [], {}),
    "b=8": ("8", ["--global-batch", "16"], [], {}),
    "torch-engine": (None, [], ["--engine", "torch"], {}),
    "adamw": (None, ["--optimizer", "adamw"], [], {"optimizer": "adamw"}),
    "replicate": (None, ["--replicate", "--stages", "3"], [], {}),
    "devices-3": (None, ["--devices", "3"], [], {}),
    "G=2": (None, ["--global-batch", "2"], [], {}),
    "schedule-auto": (None, ["--schedule", "auto"], [], {}),
    # 4 devices on one host, --stages 2 fixes p: 2 pipeline ranks x 2 replicas (--devices 4 picks
    # p = 1 for these tiny models)
    "2x2": (None, ["--topology", "{topology}"], [], {}),
    "2x2-zero-2": (None, ["--topology", "{topology}", "--shard", "gradients"], [], {}),
    "2x2-zero-3": (None, ["--topology", "{topology}", "--shard", "parameters"], [], {}),
    "2x2-zb-v": (None, ["--topology", "{topology}", "--schedule", "zb-v"], [], {}),
}
TOPOLOGY = {"levels": [{"name": "host", "count": 1}, {"name": "device", "count": 4}]}
STEPS, LR, EXACT, TIMEOUT = 3, 0.05, 1e-5, 300


class Refused(Exception):
    """A command stopped in one line with exit status 2."""


class Failed(Exception):
    """A traceback, another exit status or a hang."""


def _run(args: List[str]) -> str:
    try:
        result = run_cli(args, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        raise Failed(f"{' '.join(args[:2])} hung ({TIMEOUT} s)") from None
    err = result.stderr.strip().splitlines()
    if result.returncode == 2 and len(err) == 1 and "Traceback" not in result.stderr:
        raise Refused(f"{args[1]}: {err[0]}")
    if result.returncode != 0:
        said = [line for line in err if line.startswith("error:")]  # runtime execute: "error: rank 0 failed: ..."
        last = (said or err or result.stdout.strip().splitlines() or ["?"])[-1]
        raise Failed(f"{args[1]} exit {result.returncode}: {last}" + (" (traceback)" if "Traceback" in result.stderr else ""))
    return result.stdout


def _profile(name: str, sizes: Optional[str], tmp: str) -> str:
    sizes = sizes or SIZES.get(name, "1,2,4")
    path = os.path.join(tmp, f"{name}-{sizes.replace(',', '_')}.json")
    if not os.path.exists(path):
        _run(profile_command(*MODELS[name][:2], sizes, path))
    return path


def _solve_args(extra: List[str]) -> List[str]:
    """The baseline with the option's flags replacing its own (--devices replaces --stages); a flag
    followed by another flag (or nothing) takes no value."""
    args = list(BASE_SOLVE)
    if "--devices" in extra:
        i = args.index("--stages")
        del args[i:i + 2]
    i = 0
    while i < len(extra):
        flag = extra[i]
        value = extra[i + 1] if i + 1 < len(extra) and not extra[i + 1].startswith("--") else None
        if value is not None and flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag] + ([value] if value is not None else [])
        i += 1 if value is None else 2
    return args


def sweep_cell(name: str, option: str, tmp: str) -> Dict[str, Any]:
    """One model with one option: profile (cached), solve, execute, compare."""
    import torch

    from planner.plan.file import load_plan
    from tests.support.runs import max_abs_diff, reference_state

    sizes, solve, execute, reference_args = OPTIONS[option]
    cell: Dict[str, Any] = {"model": name, "option": option}
    start = time.perf_counter()
    try:
        profile = _profile(name, sizes, tmp)
        plan_path, state_path = os.path.join(tmp, "plan.json"), os.path.join(tmp, "state.pt")
        topology = os.path.join(tmp, "topology.json")
        with open(topology, "w") as f:
            json.dump(TOPOLOGY, f)
        solve = [a.replace("{topology}", topology) for a in solve]
        _run(["planner.cli", "solve", profile, *_solve_args(solve), "-o", plan_path])
        plan = load_plan(plan_path)
        cell["plan"] = (f"{plan.schedule} p{plan.pipeline_stages}x{len(plan.stages)}st d{plan.data_parallel} "
                        f"b{plan.micro_batch_size}x{plan.num_micro_batches}"
                        + (f" {plan.shard}" if plan.shard != "none" else "")
                        + (f" {plan.precision}" if plan.precision != "fp32" else "")
                        + (" replicas " + ",".join(str(s.replica_count) for s in plan.stages) if plan.replicated else "")
                        + (f" rc{sum(len(s.recompute) for s in plan.stages)}" if any(s.recompute for s in plan.stages)
                           else ""))
        _run(["runtime.cli", "execute", plan_path, "--steps", str(STEPS), "--lr", str(LR), "--save-state",
              state_path, *execute])
        state = torch.load(state_path, weights_only=True)
        reference = reference_state(plan, steps=STEPS, lr=LR, **reference_args,
                                    buffers_of_replica=0 if plan.data_parallel > 1 else None)
        diff = max_abs_diff(state, reference)
        cell["diff"] = diff
        if diff > EXACT:
            cell["worst"] = worst_entries(state, reference)
        cell["result"] = "exact" if diff <= EXACT else "NOT EXACT"
    except Refused as e:
        cell["result"], cell["why"] = "refused", str(e)
    except Failed as e:
        cell["result"], cell["why"] = "FAILED", str(e)
    except Exception as e:  # the comparison itself (missing keys, shapes)
        cell["result"], cell["why"] = "FAILED", f"{type(e).__name__}: {e}"
    cell["seconds"] = round(time.perf_counter() - start, 1)
    return cell


def table(cells: List[Dict[str, Any]]) -> str:
    models = list(dict.fromkeys(c["model"] for c in cells))
    options = list(dict.fromkeys(c["option"] for c in cells))
    at = {(c["model"], c["option"]): c for c in cells}

    def text(c: Optional[Dict[str, Any]]) -> str:
        if c is None:
            return ""
        if c["result"] == "exact":
            return f"{c['diff']:.0e}"
        if c["result"] == "NOT EXACT":
            return f"**{c['diff']:.1e}**"
        return "refused" if c["result"] == "refused" else "**FAILED**"

    lines = ["| option | " + " | ".join(models) + " |", "|---|" + "---:|" * len(models)]
    for o in options:
        lines.append(f"| {o} | " + " | ".join(text(at.get((m, o))) for m in models) + " |")
    notes = [f"- {c['model']} / {c['option']}: {c['why']}" for c in cells if "why" in c]
    return "\n".join(lines + ([""] + notes if notes else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--options", default="", help=f"comma-separated subset of {','.join(OPTIONS)}")
    parser.add_argument("--json", default=None, help="also append the cells as JSON lines here")
    parser.add_argument("--table", default=None, metavar="JSONL",
                        help="print the table of a --json file (runs in chunks: each cell's last run) and stop")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            last = {(c["model"], c["option"]): c for c in map(json.loads, f)}
        order = {name: k for k, name in enumerate([*MODELS, *OPTIONS])}
        print(table(sorted(last.values(), key=lambda c: (order.get(c["model"], 99), order.get(c["option"], 99)))))
        return
    names = [n for n in args.only.split(",") if n] or list(MODELS)
    options = [o for o in args.options.split(",") if o] or list(OPTIONS)
    unknown = [n for n in names if n not in MODELS] + [o for o in options if o not in OPTIONS]
    if unknown:
        parser.error(f"unknown model(s) or option(s) {unknown}; models: {', '.join(MODELS)}; "
                     f"options: {', '.join(OPTIONS)}")
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for option in options:
                cells.append(sweep_cell(name, option, tmp))
                print(json.dumps(cells[-1]), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(cells[-1]) + "\n")
    print(table(cells))


if __name__ == "__main__":
    main()
