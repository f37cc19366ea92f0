"""Every runtime feature against single-process training (max abs diff <= 1e-5), and failures."""
import contextlib
import io
import json
import os
import time

import pytest
import torch

from planner.jsonio import write_json_atomic
from runtime.cli import main as runtime_main
from planner.plan.file import save_plan
from tests.support.runs import (execute, max_abs_diff, plan_with, profile_of, report_of, reference_state,
                            reshape_plan, run_cli)
from tests.support.runs import ranks_left, run_here


def _gpt_plan(cuts, b=2, g=8, schedule="1f1b"):
    return plan_with(profile_of("builtin:gpt", {"layers": 6}), cuts, b, g, schedule)


@pytest.mark.parametrize("schedule", ["interleaved", "bfs"])
def test_multi_stage_schedules(tmp_path, schedule):
    # 4 stages on 2 ranks, looping placement: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3;
    # each rank receives both directions from the same peer, in batches
    plan = reshape_plan(_gpt_plan([2, 5, 7], b=2, g=8), virtual_stages=2, schedule=schedule)
    state = execute(plan, tmp_path)
    assert max_abs_diff(state, reference_state(plan)) <= 1e-5
    assert [s["chunks"] for s in report_of(tmp_path)["stages"]] == [[0, 2], [1, 3]]


def test_data_parallel_2x2(tmp_path):
    plan = reshape_plan(_gpt_plan([5], b=2, g=4), data_parallel=2)  # 4 ranks, global batch 8
    assert plan.global_batch == 8
    state = execute(plan, tmp_path)
    losses = []
    assert max_abs_diff(state, reference_state(plan, losses=losses)) <= 1e-5
    assert [s["loss"] for s in report_of(tmp_path)["steps"]] == pytest.approx(losses, rel=1e-5)


def test_recomputation(tmp_path):
    plan = reshape_plan(_gpt_plan([5]), recompute={0: ["blocks.1", "blocks.2"], 1: ["blocks.4", "head"]})
    state = execute(plan, tmp_path)
    assert max_abs_diff(state, reference_state(plan)) <= 1e-5


def test_adamw(tmp_path):
    plan = _gpt_plan([4])
    state = execute(plan, tmp_path, lr=1e-3, extra=["--optimizer", "adamw"])
    assert max_abs_diff(state, reference_state(plan, lr=1e-3, optimizer="adamw")) <= 1e-5


def test_a_plan_for_adam_runs_adam(tmp_path):
    # `planner solve --optimizer adam`: the run steps with torch's Adam (weight decay an L2 term, not
    # AdamW's decoupled decay); the ranks' argument parser refused the plan's optimizer name
    import dataclasses

    plan = dataclasses.replace(_gpt_plan([4]), optimizer="adam")
    state = execute(plan, tmp_path, steps=2, lr=1e-3, extra=["--weight-decay", "0.5"])
    decay = dict(weight_decay=0.5)
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=1e-3, optimizer="adam", training=decay)) <= 1e-5
    assert max_abs_diff(state, reference_state(plan, steps=2, lr=1e-3, optimizer="adamw", training=decay)) > 1e-4


def test_tied_weights_across_stages(tmp_path):
    plan = plan_with(profile_of("tests.models:tied_lm"), [2], 2, 8, "1f1b")  # emb on rank 0, head on rank 1
    state = execute(plan, tmp_path)
    reference = reference_state(plan)
    assert max_abs_diff(state, reference) <= 1e-5
    assert torch.equal(state["emb.weight"], state["head.weight"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_aliased_parameter_gets_one_update(tmp_path, schedule):
    # head.bias is the model's `bias` (one tensor, two names, one unit); head.weight is emb.weight on the
    # other rank: every name of every parameter must hold the single-process value
    args = {"aliased_bias": True}
    plan = plan_with(profile_of("tests.models:tied_lm", args), [2], 2, 8, schedule)
    state = execute(plan, tmp_path)
    reference = reference_state(plan)
    assert max_abs_diff(state, reference) <= 1e-5
    assert torch.equal(state["bias"], state["head.bias"]) and torch.equal(state["emb.weight"], state["head.weight"])
    assert state["bias"].abs().max() > 1e-4  # the bias was trained (it starts at zero)


def test_trace_and_timeline(tmp_path):
    plan = _gpt_plan([4])
    trace_path, png = str(tmp_path / "trace.json"), str(tmp_path / "timeline.png")
    execute(plan, tmp_path, steps=2, extra=["--trace", trace_path, "--timeline", png])
    events = json.load(open(trace_path))["traceEvents"]
    kinds = {(e["tid"], e["cat"]) for e in events if e["ph"] == "X"}
    for rank in (0, 1):
        assert (rank, "forward") in kinds and (rank, "backward") in kinds and (rank, "optimizer_step") in kinds
    assert (0, "send_act") in kinds and (1, "recv_act") in kinds
    assert sum(1 for e in events if e["ph"] == "X" and e["cat"] == "forward" and e["tid"] == 0) == 2 * 4
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_rank_killed_with_sigkill_takes_the_others_down(tmp_path):
    plan = plan_with(profile_of("tests.models:killed"), [2], 2, 4)
    plan_path = str(tmp_path / "plan.json")
    save_plan(plan, plan_path)
    start = time.monotonic()
    result = run_here(["runtime.cli", "execute", plan_path, "--steps", "3", "--timeout", "60"])
    assert result.returncode == 1
    assert "rank 1 failed: killed by signal SIGKILL" in result.stderr
    assert time.monotonic() - start < 30
    assert ranks_left() == []


def test_the_cause_is_the_first_error_file_even_of_a_rank_still_leaving(tmp_path):
    # CI: rank 0 wrote its error and was still tearing down when rank 1, which lost its peer, had
    # exited; naming an exited rank only reported rank 1's "Connection closed by peer"
    from runtime.launch import _first_cause

    (tmp_path / "rank0.error").write_text("InitStateError: no entry\n")
    (tmp_path / "rank1.error").write_text("RuntimeError: Connection closed by peer\n")
    os.utime(tmp_path / "rank0.error", ns=(10 ** 18, 10 ** 18))
    os.utime(tmp_path / "rank1.error", ns=(10 ** 18 + 10 ** 6, 10 ** 18 + 10 ** 6))
    assert _first_cause(str(tmp_path), [1], [None, 1]) == 0
    assert _first_cause(str(tmp_path), [0, 1], [-9, 1]) == 0  # a killed rank is the cause
    (tmp_path / "rank0.error").unlink()
    assert _first_cause(str(tmp_path), [1], [None, 1]) == 1


def test_a_rank_error_whose_text_starts_with_a_blank_line_names_its_first_line(tmp_path, monkeypatch):
    # torch's "Can't detach views in-place" starts with a newline: the launcher printed "RuntimeError: "
    import types

    from runtime.worker import _write_error

    monkeypatch.setenv("RANK", "1")
    _write_error(types.SimpleNamespace(out_dir=str(tmp_path)), RuntimeError("\n  Can't detach views in-place.\nmore"))
    assert (tmp_path / "rank1.error").read_text() == "RuntimeError: Can't detach views in-place\n"


def test_ranks_with_different_plans_refuse_to_start(tmp_path):
    import subprocess
    import sys

    from runtime.launch import free_port
    from tests.support.runs import ROOT

    plan = _gpt_plan([4])
    paths = [str(tmp_path / f"plan{r}.json") for r in range(2)]
    write_json_atomic(paths[0], plan.to_json())
    write_json_atomic(paths[1], dict(plan.to_json(), note="edited"))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "runtime.worker", paths[r], "--out-dir", str(tmp_path),
                               "--timeout", "30"],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, PYTHONPATH=ROOT),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(2)]
    codes = [p.wait(timeout=90) for p in procs]
    assert codes == [1, 1]
    assert "differs from rank 0's" in open(tmp_path / "rank1.error").read()


def test_torchrun_runs_the_same_worker(tmp_path):
    plan = _gpt_plan([4])
    plan_path = str(tmp_path / "plan.json")
    save_plan(plan, plan_path)
    out = str(tmp_path / "out")
    result = run_cli(["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "runtime.worker",
                      plan_path, "--out-dir", out, "--steps", "3", "--lr", "0.05", "--save-state"], timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    state = {}
    for r in range(2):
        state.update(torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True))
    assert max_abs_diff(state, reference_state(plan)) <= 1e-5


def test_recomputed_units_keep_only_their_inputs():
    """In-process: a recomputed unit saves less for backward, and its gradients are unchanged."""
    from runtime.stage import build_rank

    plan = _gpt_plan([5])
    plain = reshape_plan(plan)
    again = reshape_plan(plan, recompute={0: ["blocks.0", "blocks.1", "blocks.2"]})

    def saved_bytes_and_grads(p):
        model = build_rank(p, p.topology(), 0)
        stage = model.stages[0]
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        (idx,), _ = model.spec.batch(2, 0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = stage.module(idx)
        torch.autograd.backward([o for o in out if o.requires_grad], [torch.ones_like(o) for o in out
                                                                        if o.requires_grad])
        return sum(storages.values()), {n: p.grad.clone() for n, p in stage.module.named_parameters()}

    plain_bytes, plain_grads = saved_bytes_and_grads(plain)
    again_bytes, again_grads = saved_bytes_and_grads(again)
    assert again_bytes < 0.6 * plain_bytes
    names = lambda grads: {n.split("parts.", 1)[-1].split(".", 1)[-1] if n.startswith("parts.") else n: g
                           for n, g in grads.items()}
    assert max_abs_diff(names(plain_grads), names(again_grads)) <= 1e-6


def test_show_prints_checked_lists_and_bad_plans_fail_before_starting(tmp_path):
    plan = reshape_plan(_gpt_plan([2, 5, 7], b=2, g=8), virtual_stages=2, schedule="interleaved")
    path = str(tmp_path / "plan.json")
    save_plan(plan, path)
    shown = run_cli(["runtime.cli", "show", path])
    assert shown.returncode == 0, shown.stderr
    assert "rank 0 (stages 0,2" in shown.stdout and "no rank can wait forever" in shown.stdout
    # interleaved needs m divisible by p; a global batch that does not split evenly is refused too
    for bad in (dict(plan.to_json(), num_micro_batches=3, global_batch=6), dict(plan.to_json(), global_batch=10)):
        write_json_atomic(path, bad)
        for command in (["show", path], ["execute", path]):  # refused before any rank starts: in this process
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = runtime_main(command)
            assert code == 2, (command, out.getvalue(), err.getvalue())
            assert "Traceback" not in err.getvalue() and "error:" in err.getvalue()
    # a model no rank can build (the twenty-sixth session's fuzz: every rank started, then failed)
    for entry, words in (("zzz", "the plan's model 'zzz' is not 'builtin:NAME' or 'package.module:function'"),
                         ("builtin:nope", "the plan's unknown built-in model 'nope'")):
        bad = plan.to_json()
        bad["model"] = dict(bad["model"], entry=entry)
        write_json_atomic(path, bad)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            assert runtime_main(["execute", path]) == 2
        assert words in err.getvalue() and len(err.getvalue().splitlines()) == 1, err.getvalue()


@pytest.mark.parametrize("schedule", ["interleaved", "bfs"])
def test_stages_on_one_rank_hand_over_in_memory(tmp_path, schedule):
    # 3 stages on one rank: no messages; each forward takes the previous stage's outputs, each
    # backward the gradients the next stage's backward left
    plan = reshape_plan(_gpt_plan([2, 5]), virtual_stages=3, schedule=schedule)
    state = execute(plan, tmp_path)
    assert max_abs_diff(state, reference_state(plan)) <= 1e-5


def test_resume_with_adamw_and_dropout_is_exact(tmp_path):
    # the optimizer state and the random generators are part of the checkpoint: after resuming, the
    # steps, losses, dropout masks and parameters are the uninterrupted run's
    plan = plan_with(profile_of("tests.models:dropout_mlp", sizes=(2,)), [2], 2, 8, "1f1b")
    adamw = ["--optimizer", "adamw"]
    straight = execute(plan, tmp_path / "a", steps=4, lr=1e-3, extra=adamw)
    straight_losses = [s["loss"] for s in report_of(tmp_path / "a")["steps"]]
    ckpt = str(tmp_path / "ckpt")
    execute(plan, tmp_path / "b", steps=2, lr=1e-3, extra=[*adamw, "--checkpoint-dir", ckpt, "--checkpoint-every", "2"])
    assert json.load(open(os.path.join(ckpt, "latest.json")))["completed_steps"] == 2
    resumed = execute(plan, tmp_path / "c", steps=4, lr=1e-3, extra=[*adamw, "--checkpoint-dir", ckpt, "--resume"])
    resumed_steps = report_of(tmp_path / "c")["steps"]
    assert [s["step"] for s in resumed_steps] == [2, 3]
    assert [s["loss"] for s in resumed_steps] == straight_losses[2:]
    assert max_abs_diff(resumed, straight) == 0


def test_a_loss_no_backward_can_start_from_stops_the_run_in_one_line(tmp_path):
    """A loss changed after profiling to a vector, a number or a value that needs no gradient: the last
    rank says so (it stopped on torch's shape mismatch or a missing `detach`, or, for a value that needs
    no gradient, trained nothing where one process's backward refuses); under --engine torch too, whose
    stage wraps the error ("[Stage 1] failed to run forward:") with the cause after it."""
    plan = plan_with(profile_of("tests.capture_models:bad_loss", {"kind": "mean"}, sizes=(2,)), [2], 2, 4)
    path = str(tmp_path / "plan.json")
    cases = [("vector", "own", "returned a tensor of shape (2,), not one number"),
             ("number", "own", "returned a float, not a tensor"),
             ("no_grad", "own", "returned a value that needs no gradient"),
             ("no_grad", "torch", "failed to run forward: ValueError: the loss function returned a value that needs "
                                  "no gradient")]
    for kind, engine, words in cases:
        bad = plan.to_json()
        bad["model"] = dict(bad["model"], args={"kind": kind})
        write_json_atomic(path, bad)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = runtime_main(["execute", path, "--steps", "1", "--engine", engine])
        errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
        assert code == 1 and len(errors) == 1 and "rank 1 failed: " in errors[0], (kind, engine, err.getvalue())
        assert words in errors[0], (kind, engine, errors[0])


_SEMAPHORES = """
import multiprocessing
import multiprocessing.resource_tracker as tracker
import sys
import torch
multiprocessing.set_start_method("forkserver")  # a rank's (forked by the fork server): its semaphores are named
registered = []
tracker.register = lambda name, kind: registered.append(kind)
if sys.argv[1] == "rank":
    from runtime.launch import _no_process_locks_for_progress_bars
    _no_process_locks_for_progress_bars()
graph = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
torch.fx.Interpreter(graph).run(torch.ones(1, 2))
print(registered.count("semaphore"))
"""


def test_a_rank_interpreting_a_graph_makes_no_semaphore_it_would_leak():
    """torch.fx's Interpreter opens a tqdm bar, whose first makes a multiprocessing lock: a named
    semaphore a forked rank (ending with os._exit) never unlinked, so `runtime execute` ended with
    "leaked semaphore objects" after a model routing tokens by index (its stages interpreted)."""
    pytest.importorskip("tqdm")
    import subprocess
    import sys

    from tests.support.runs import ROOT

    def semaphores(where: str) -> int:
        done = subprocess.run([sys.executable, "-c", _SEMAPHORES, where], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    assert semaphores("plain") == 1  # what a process gets without it
    assert semaphores("rank") == 0
