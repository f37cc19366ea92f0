"""Training options against one process with torch's own tools: SGD momentum and weight decay,
AdamW's betas and decay, a warm-up + cosine schedule, clipping by the global norm (tied weights,
replicated stages and data-parallel replicas counted once), and bf16 autocast."""
import dataclasses

import pytest

from planner.plan.file import save_plan
from tests.support.runs import execute, max_abs_diff, plan_with, profile_of, reference_state, report_of, reshape_plan

SCHEDULE = {"schedule": "cosine", "warmup_steps": 1, "min_lr": 0.001}
FLAGS = ["--lr-schedule", "cosine", "--warmup-steps", "1", "--min-lr", "0.001"]


def test_sgd_momentum_decay_schedule_and_clipping_with_ties_and_replicas(tmp_path):
    # the embedding (rank 0) and the head (rank 1) share a weight; 2 data-parallel replicas: 4 ranks
    plan = reshape_plan(plan_with(profile_of("tests.models:tied_lm"), [2], 2, 4, "1f1b"), data_parallel=2)
    training = dict(momentum=0.9, weight_decay=0.01, clip_grad_norm=0.05, **SCHEDULE)
    state = execute(plan, tmp_path, steps=4, lr=0.1,
                    extra=["--momentum", "0.9", "--weight-decay", "0.01", "--clip-grad-norm", "0.05", *FLAGS])
    assert max_abs_diff(state, reference_state(plan, steps=4, lr=0.1, training=training)) <= 1e-5
    unclipped = dict(training, clip_grad_norm=None)  # the clipping did something
    assert max_abs_diff(state, reference_state(plan, steps=4, lr=0.1, training=unclipped)) > 1e-4


def test_adamw_options_and_clipping_with_a_replicated_stage(tmp_path):
    plan = reshape_plan(plan_with(profile_of("builtin:gpt", {"layers": 4}), [3], 1, 8, "1f1b"), replicas=[1, 2])
    training = dict(betas=(0.8, 0.95), weight_decay=0.1, clip_grad_norm=0.5, **SCHEDULE)
    state = execute(plan, tmp_path, steps=3, lr=1e-3,
                    extra=["--optimizer", "adamw", "--betas", "0.8,0.95", "--weight-decay", "0.1",
                           "--clip-grad-norm", "0.5", *FLAGS])
    reference = reference_state(plan, steps=3, lr=1e-3, optimizer="adamw", training=training)
    assert max_abs_diff(state, reference) <= 1e-5


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_bf16_autocast_matches_one_bf16_process(tmp_path, schedule):
    # zb-v: two stages per rank, and each backward in two parts, whose weight part must reach the
    # fp32 masters through the step's bf16 copies
    plan = plan_with(profile_of("builtin:gpt", {"layers": 4}), [1, 2, 3] if schedule == "zb-v" else [2], 2, 8,
                     schedule)
    if schedule == "1f1b":  # a recomputed unit runs its forward again in backward, with the step's bf16 weights
        plan = reshape_plan(plan, recompute={1: ["blocks.1", "head"]})
    plan = dataclasses.replace(plan, precision="bf16-mixed")  # as `planner solve --precision bf16-mixed` plans it
    state = execute(plan, tmp_path, steps=3, lr=1.0)  # the plan's precision
    # the same autocast in one process: the same bf16 kernels on the same values
    losses, fp32_losses = [], []
    bf16 = max_abs_diff(state, reference_state(plan, lr=1.0, losses=losses, training={"precision": "bf16-mixed"}))
    fp32 = max_abs_diff(state, reference_state(plan, lr=1.0, losses=fp32_losses))
    print(f"bf16 run against one bf16 process {bf16:.3g}, against fp32 {fp32:.3g}")
    assert bf16 <= 1e-5 < fp32
    measured = [s["loss"] for s in report_of(tmp_path)["steps"]]
    assert measured == pytest.approx(losses, rel=1e-6)
    assert max(abs(a - b) for a, b in zip(measured, fp32_losses)) > 1e-5


def _in_process(args):
    """runtime.cli's exit code and what it wrote to stderr, run in this process (importing torch in
    a process of its own costs each case about 2 s)."""
    import contextlib
    import io

    from runtime.cli import main as runtime_main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = runtime_main(args)
        except SystemExit as e:  # argparse's own refusals
            code = e.code
    return code, err.getvalue()


def test_bad_training_options_fail_in_one_line(tmp_path):
    plan = plan_with(profile_of("builtin:gpt", {"layers": 4}), [2], 2, 8, "1f1b")
    path = str(tmp_path / "plan.json")
    save_plan(plan, path)
    for flags, words in [(["--betas", "0.9"], "two numbers"), (["--clip-grad-norm", "0"], "positive"),
                         (["--momentum", "-1"], "0 or more"), (["--lr", "0"], "positive"),
                         (["--lr", "1e308"], "at most 1e6"), (["--weight-decay", "nan"], "finite"),
                         (["--timeout", "nan"], "--timeout is seconds"), (["--threads", "100000"], "--threads is"),
                         (["--checkpoint-dir", str(tmp_path / "c"), "--checkpoint-every", "-1"], "K >= 1"),
                         (["--report", str(tmp_path)], "is a directory; name a file to write"),
                         # the twenty-sixth session's fuzz: a rank that could not connect, a step count that overflowed
                         (["--timeout", "1e-9"], "at least 1"), (["--steps", str(10 ** 22)], "--steps must be 1.."),
                         # the twenty-ninth session's fuzz: options the run ignored
                         (["--betas", "0.5,0.9"], "--betas are Adam's and AdamW's; this run steps with sgd"),
                         (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum is SGD's; this run steps with adamw"),
                         (["--lr", "0.01", "--min-lr", "0.1"], "--min-lr 0.1 is above --lr 0.01")]:
        code, err = _in_process(["execute", path, *flags])  # (test_cli runs the command as a process)
        assert code == 2 and words in err and len(err.splitlines()) == 1, (flags, err)


def test_a_run_in_another_precision_than_the_plan_is_refused(tmp_path):
    """The plan's memory is that of its precision: a run asking another is refused in one line."""
    from planner.plan.file import save_plan

    plan = plan_with(profile_of("builtin:mlp"), [2], 2, 4, "1f1b")
    path = str(tmp_path / "plan.json")
    save_plan(plan, path)
    for extra, needle in ((["--precision", "bf16-mixed"], "re-plan with `planner solve --precision bf16-mixed`"),
                          (["--precision", "bf16"], "invalid choice")):
        code, err = _in_process(["execute", path, "--steps", "1", *extra])
        assert code == 2 and needle in err and "Traceback" not in err, err


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_loss_of_one_element_not_a_scalar_trains_like_one_process(tmp_path, schedule):
    # the engine seeds a loss's backward with its share of the step: in the loss's own shape
    plan = plan_with(profile_of("tests.models:one_element_loss", sizes=(1,)), [4], 1, 3, schedule)
    state = execute(plan, tmp_path, steps=2)
    assert max_abs_diff(state, reference_state(plan, steps=2)) <= 1e-5
