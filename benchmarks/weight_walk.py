"""A later stage's weight part (zero-bubble schedules) as the profile predicts it and as it runs.

    .venv/bin/python benchmarks/weight_walk.py                      # builtin:gpt as `make demo` profiles it
    .venv/bin/python benchmarks/weight_walk.py --entry builtin:resnet --args '{}' --size 4

The model is profiled (`planner profile`'s measurement, at one micro-batch size), then every last
stage [a, L), a >= 1, is built as the runtime builds it and its backward's two parts are timed in
this process (`measure_backward_parts`, round-robin over the stages). Each is compared with
planner.cost.ranges' prediction from the profile, and with the rule before the walk term: the
units' weight parts scaled in proportion so that the stage [1, L) costs what it measured (its
excess over the units alone spread over them, linear in a stage's units).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from planner.cost.ranges import RangeCosts  # noqa: E402
from planner.model.capture import capture, run_all_nodes  # noqa: E402
from planner.model.entry import build_spec  # noqa: E402
from planner.profile.measure import profile_model  # noqa: E402
from planner.profile.splitgrad import measure_backward_parts  # noqa: E402
from planner.profile.timing import UnitCall  # noqa: E402

DEMO = ("builtin:gpt", {"vocab": 8192, "layers": 6, "dim": 64})


def last_stages(entry: str, args: dict, b: int, profile) -> list:
    """UnitCalls of every stage [a, L), a >= 1, on the profile's batch, as the last rank runs them."""
    spec = build_spec(entry, args, 0)
    captured = capture(spec.module)
    L = len(captured.units)
    inputs, target = spec.batch(b, 0)
    values = run_all_nodes(captured, inputs)
    calls = []
    for a in range(1, L):
        stage, io = captured.stage_module(a, L)
        grads = {v.name: v.requires_grad for v in profile.cut(a).values}
        args_ = []
        for name in io.inputs + io.received:
            value = values[name]
            if isinstance(value, torch.Tensor):
                value = value.detach().clone().requires_grad_(bool(grads.get(name)))
            args_.append(value)
        calls.append(UnitCall(stage, args_, [], True))
    return calls, spec.loss, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entry", default=DEMO[0])
    parser.add_argument("--args", default=json.dumps(DEMO[1]), help="model arguments as JSON")
    parser.add_argument("--size", type=int, default=2, help="micro-batch size")
    parser.add_argument("--repeats", type=int, default=25, help="timed rounds over the stages")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    args = json.loads(opts.args)
    profile = profile_model(opts.entry, args, [opts.size])
    costs = RangeCosts(profile, opts.size)
    L = costs.num_units
    calls, loss, target = last_stages(opts.entry, args, opts.size, profile)
    parts = measure_backward_parts(calls, loss, target, torch.device("cpu"), opts.repeats)
    # the rule before the walk term: [1, L) as measured, spread over the units in proportion
    whole, units = costs.backward_weight(1, L), costs.gw[1:].sum()
    proportional = lambda a: costs.gw[a:].sum() * (whole - costs.later_weight) / units + costs.later_weight  # noqa: E731
    print(f"{opts.entry} {args}, b = {opts.size}, {L} units, {platform.node()}, torch {torch.__version__}; "
          f"walk {profile.weight_walk_s.get(opts.size, 0.0) * 1e9:.0f} ns per node per call")
    print("| stage | weight part measured ms | predicted ms (walk term) | error | proportional rule ms | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for a, part in zip(range(1, L), parts):
        predicted, old = costs.backward_weight(a, L), proportional(a)
        print(f"| [{a}, {L}) | {part.weight_s * 1e3:.3f} | {predicted * 1e3:.3f} | {(predicted / part.weight_s - 1) * 100:+.1f} % "
              f"| {old * 1e3:.3f} | {(old / part.weight_s - 1) * 100:+.1f} % |")


if __name__ == "__main__":
    main()
