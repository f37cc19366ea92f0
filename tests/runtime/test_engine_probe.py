"""The engine's own cost per forward and backward (runtime/engine_probe.py), measured on a null stage."""
import time

from runtime import engine_probe
from runtime.engine import Engine


def test_the_null_stage_measures_what_the_engine_adds_and_only_that(monkeypatch):
    forward, backward = engine_probe.engine_overhead(min_time_s=0.0, min_rounds=5)
    assert 0.0 <= forward < 2e-3 and 0.0 <= backward < 2e-3  # microseconds of Python, not milliseconds
    # an engine 3 ms slower per forward is measured so, and its backward is not
    slow = Engine._forward

    def slower(self, step, action):
        time.sleep(3e-3)
        slow(self, step, action)

    monkeypatch.setattr(Engine, "_forward", slower)
    slow_forward, slow_backward = engine_probe.engine_overhead(min_time_s=0.0, min_rounds=5)
    # a sleep never ends early, and a loaded host (CI's two cores) may wake it late
    assert 2e-3 <= slow_forward - forward <= 6e-3
    assert slow_backward < 1e-3
