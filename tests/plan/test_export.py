"""`planner export PLAN --format torchtitan|torch`: torchtitan's pipeline config names every unit of
the model exactly once, in stage order, with torch's schedule name; the torch script compiles."""
import os

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

from planner.cli.main import main as planner_main
from planner.plan.file import save_plan
from tests.support.runs import plan_with, profile_of, reshape_plan


def _export(tmp_path, plan, fmt, capsys):
    path = os.path.join(str(tmp_path), "plan.json")
    save_plan(plan, path)
    code = planner_main(["export", path, "--format", fmt])
    return code, capsys.readouterr()


@pytest.mark.parametrize("schedule,v,d", [("1f1b", 1, 2), ("interleaved", 2, 1), ("bfs", 2, 1)])
def test_torchtitan_config_names_every_module_once(tmp_path, capsys, schedule, v, d):
    from torch.distributed.pipelining.schedules import get_schedule_class

    profile = profile_of("builtin:gpt")
    plan = reshape_plan(plan_with(profile, [1, 3, 6], 2, 8, "gpipe"), virtual_stages=v, data_parallel=d,
                        schedule=schedule) if v > 1 else reshape_plan(plan_with(profile, [4], 2, 8, "1f1b"),
                                                                      data_parallel=d)
    code, out = _export(tmp_path, plan, "torchtitan", capsys)
    assert code == 0, out.err
    config = tomllib.loads(out.out)
    par, training = config["parallelism"], config["training"]
    parts = par["module_fqns_per_model_part"]
    assert [name for part in parts for name in part] == [u.name for u in profile.units]
    assert parts == [st.units for st in plan.stages]
    assert par["pipeline_parallel_degree"] == plan.pipeline_stages and par["data_parallel_replicate_degree"] == d
    get_schedule_class(par["pipeline_parallel_schedule"])  # a name torch (and torchtitan) knows
    assert training["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == plan.num_micro_batches


def test_torch_snippet_compiles_and_builds_the_stages(tmp_path, capsys):
    import torch

    from planner.model.entry import build_spec

    args = {"layers": 4}  # a chain of units, what the snippet's StagePart calls in order
    plan = reshape_plan(plan_with(profile_of("builtin:mlp", args), [1, 3, 5], 2, 8, "gpipe"), virtual_stages=2,
                        schedule="interleaved")
    code, out = _export(tmp_path, plan, "torch", capsys)
    assert code == 0, out.err
    namespace = {"__name__": "snippet"}
    exec(compile(out.out, "snippet.py", "exec"), namespace)  # defines, runs nothing (not __main__)
    assert namespace["MODULES_PER_STAGE"] == [st.units for st in plan.stages]
    assert "ScheduleInterleaved1F1B(stages," in out.out
    # the stages it builds hold every parameter of the model once, and in order they are the model
    spec = build_spec("builtin:mlp", args, seed=0)
    parts = [namespace["StagePart"](spec.module, names) for names in namespace["MODULES_PER_STAGE"]]
    held = [id(q) for part in parts for q in part.parameters()]
    assert sorted(held) == sorted(id(q) for q in spec.module.parameters())
    inputs, _ = spec.batch(2, 0)
    x = inputs[0]
    for part in parts:
        x = part(x)
    torch.testing.assert_close(x, spec.module(*inputs), rtol=0, atol=0)


def test_export_refuses_replicated_stages_in_one_line(tmp_path, capsys):
    plan = reshape_plan(plan_with(profile_of("builtin:gpt"), [4], 2, 8, "1f1b"), replicas=[1, 2])
    target = os.path.join(str(tmp_path), "out.toml")
    path = os.path.join(str(tmp_path), "plan.json")
    save_plan(plan, path)
    assert planner_main(["export", path, "--format", "torchtitan", "-o", target]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "replicated" in err
    assert not os.path.exists(target)


def test_export_refuses_a_zero_bubble_plan_in_one_line(tmp_path, capsys):
    plan = plan_with(profile_of("builtin:gpt"), [4], 2, 8, "zb-h1")
    code, out = _export(tmp_path, plan, "torch", capsys)
    assert code == 2 and len(out.err.strip().splitlines()) == 1 and "zb-h1" in out.err and "Traceback" not in out.err


def test_export_refuses_a_sharded_plan_in_one_line(tmp_path, capsys):
    import dataclasses

    plan = dataclasses.replace(reshape_plan(plan_with(profile_of("builtin:gpt"), [4], 2, 8, "1f1b"), data_parallel=2),
                               shard="optimizer")
    code, out = _export(tmp_path, plan, "torchtitan", capsys)
    assert code == 2 and len(out.err.strip().splitlines()) == 1 and "--shard none" in out.err


@pytest.mark.parametrize("fmt", ["torch", "torchtitan"])
def test_export_refuses_fewer_1f1b_micro_batches_than_stages_in_one_line(tmp_path, capsys, fmt):
    """Three stages, two micro-batches, 1F1B: the export wrote a script (and a config) whose Schedule1F1B raises
    when built ("Number of microbatches (2) must be greater than or equal to the number of stages (3)"); GPipe
    takes any count."""
    plan = plan_with(profile_of("builtin:gpt"), [2, 4], 4, 8, "1f1b")
    code, out = _export(tmp_path, plan, fmt, capsys)
    assert code == 2 and len(out.err.strip().splitlines()) == 1 and "at least 3" in out.err, out.err
    code, out = _export(tmp_path, plan_with(profile_of("builtin:gpt"), [2, 4], 4, 8, "gpipe"), fmt, capsys)
    assert code == 0, out.err
