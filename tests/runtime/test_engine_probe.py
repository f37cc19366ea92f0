"""The engine's own cost per forward and backward (runtime/engine_probe.py), measured in a two-stage
pipeline: each action's clock span less the compute inside it."""
import time

import pytest
import torch

from planner.pipeline.actions import ActionKind
from runtime import engine_probe

SLEEP_S = 3e-3


@pytest.fixture(scope="module")
def engine():
    return engine_probe.two_stage_engine()


def test_the_probe_runs_both_stages_of_a_cut_carrying_two_tensors(engine):
    first, later = (engine.runners[g] for g in (0, 1))
    assert len(first.send_tensors) == 2 and len(later.recv_tensors) == 2 and later.stage.is_last
    assert [str(a) for a in engine.actions[:4]] == ["0F0", "1F0", "1B0", "0B0"]


def test_the_engine_costs_microseconds_per_action(engine):
    forward, backward = engine_probe.measure(engine, min_time_s=0.0, min_rounds=5)
    assert 0.0 < forward < 2e-3 and 0.0 < backward < 2e-3  # microseconds of Python, not milliseconds


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLEEP_S)
        return grad


class _Sleepy(torch.nn.Module):
    """A stage module that computes SLEEP_S longer in its forward and in its backward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        time.sleep(SLEEP_S)
        out = self.inner(*args)
        if isinstance(out, torch.Tensor):
            return _SleepInBackward.apply(out)
        return type(out)([_SleepInBackward.apply(out[0]), *out[1:]])


def test_the_stages_own_compute_is_not_counted(engine, monkeypatch):
    forward, backward = engine_probe.measure(engine, min_time_s=0.0, min_rounds=5)
    for runner in engine.runners.values():
        monkeypatch.setattr(runner.stage, "module", _Sleepy(runner.stage.module))
    slow_forward, slow_backward = engine_probe.measure(engine, min_time_s=0.0, min_rounds=5)
    # the module's and autograd's calls, 3 ms longer each, are paired out of the engine's cost
    assert abs(slow_forward - forward) < 1e-3 and abs(slow_backward - backward) < 1e-3


def test_what_the_engine_adds_is_counted(engine, monkeypatch):
    forward, backward = engine_probe.measure(engine, min_time_s=0.0, min_rounds=5)
    handler = engine.handlers[ActionKind.FORWARD]

    def slower(step, action):
        time.sleep(SLEEP_S)
        handler(step, action)

    monkeypatch.setitem(engine.handlers, ActionKind.FORWARD, slower)
    slow_forward, slow_backward = engine_probe.measure(engine, min_time_s=0.0, min_rounds=5)
    # a sleep never ends early, and a loaded host (CI's two cores) may wake it late
    assert 2e-3 <= slow_forward - forward <= 6e-3
    assert slow_backward - backward < 1e-3
