"""Checkpoint files read on --resume: a marker or a rank file this runtime did not write is one line
(a fuzz of every command: an AttributeError, a KeyError, a silent restart from step 0, or torch's advice
to load with weights_only=False, which would unpickle the file)."""
import json

import pytest
import torch

from runtime import checkpoint as ckpt

GOOD = {"schema_version": ckpt.CHECKPOINT_SCHEMA_VERSION, "completed_steps": 2, "plan_hash": "abc", "world_size": 2}


@pytest.mark.parametrize("marker", [
    [1, 2], dict(GOOD, completed_steps=-1), dict(GOOD, completed_steps=1.5), dict(GOOD, completed_steps="x"),
    dict(GOOD, world_size=None), {k: v for k, v in GOOD.items() if k != "completed_steps"},
    dict(GOOD, schema_version=99), dict(GOOD, plan_hash=5),
    dict(GOOD, completed_steps=10 ** 30),  # a rank overflowed on it (a torch int64)
])
def test_a_marker_this_runtime_did_not_write_is_refused(tmp_path, marker):
    (tmp_path / "latest.json").write_text(json.dumps(marker))
    with pytest.raises(ckpt.CheckpointError, match="is not one this runtime wrote"):
        ckpt.latest(str(tmp_path), "abc", 2)


def test_a_newer_releases_marker_says_upgrade(tmp_path):
    (tmp_path / "latest.json").write_text(json.dumps(dict(GOOD, schema_version=ckpt.CHECKPOINT_SCHEMA_VERSION + 1)))
    with pytest.raises(ckpt.CheckpointError, match="a newer pipeplanner wrote it .* upgrade"):
        ckpt.latest(str(tmp_path), "abc", 2)


def test_the_marker_is_read(tmp_path):
    (tmp_path / "latest.json").write_text(json.dumps(GOOD))
    assert ckpt.latest(str(tmp_path), "abc", 2) == 2
    with pytest.raises(ckpt.CheckpointError, match="different plan"):
        ckpt.latest(str(tmp_path), "other", 2)
    with pytest.raises(ckpt.CheckpointError, match="has 2 ranks"):
        ckpt.latest(str(tmp_path), "abc", 4)


class Payload:
    def __reduce__(self):  # what unpickling it would run
        return (print, ("unpickled",))


def test_a_rank_file_is_never_unpickled_and_a_foreign_one_is_one_line(tmp_path, capsys):
    step = tmp_path / "step-000002"
    step.mkdir()
    for content in (b"garbage", None, {"completed_steps": 2}):
        path = step / "rank0.pt"
        if content is None:
            torch.save({"chunks": {}, "optimizer": {}, "payload": Payload()}, str(path))
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(content, str(path))
        with pytest.raises(ckpt.CheckpointError, match="rank0.pt.* (not a checkpoint this runtime wrote|lacks)") as e:
            ckpt.load_rank(str(tmp_path), 2, 0)
        assert "weights_only" not in str(e.value)
    assert "unpickled" not in capsys.readouterr().out


def test_another_ranks_or_models_file_is_one_line():
    # the twenty-sixth session's fuzz: rank files swapped gave "KeyError: '0'", a tensor of another shape
    # torch's first line alone ("Error(s) in loading state_dict for Stage_0_3:")
    from torch import nn

    class Stage:
        def __init__(self, index):
            self.index, self.module = index, nn.Linear(4, 4)

    stages = [Stage(0)]
    optimizer = torch.optim.SGD(stages[0].module.parameters(), lr=0.1)
    good = {"chunks": {"0": stages[0].module.state_dict()}, "optimizer": optimizer.state_dict()}
    ckpt.restore_rank(good, stages, optimizer, "here")
    with pytest.raises(ckpt.CheckpointError, match="holds no stage 0 .it holds 1.: not this rank's file"):
        ckpt.restore_rank({"chunks": {"1": good["chunks"]["0"]}, "optimizer": good["optimizer"]}, stages, optimizer,
                          "here")
    wrong = {"chunks": {"0": dict(good["chunks"]["0"], weight=torch.zeros(3))}, "optimizer": good["optimizer"]}
    with pytest.raises(ckpt.CheckpointError, match="does not fit stage 0 .size mismatch for weight") as e:
        ckpt.restore_rank(wrong, stages, optimizer, "here")
    assert "\n" not in str(e.value)


def test_resuming_a_run_that_has_all_its_steps_is_refused(tmp_path):
    # the twenty-ninth session's fuzz: --resume from a checkpoint at or past --steps trained nothing, printed
    # measured 0.00 ms (error -100 %) and wrote a report planner check and calibrate refuse, with exit 0
    from tests.support.runs import run_here

    profile, plan, checkpoints = (str(tmp_path / name) for name in ("profile.json", "plan.json", "checkpoints"))
    quick = ["--micro-batch-sizes", "1", "--link", "none", "--engine-cost", "none", "--min-time", "0", "--warmup",
             "0", "--repeats", "1", "--quiet"]
    for args in (["planner.cli", "profile", "builtin:mlp", *quick, "-o", profile],
                 ["planner.cli", "solve", profile, "--stages", "2", "--global-batch", "2", "--quiet", "-o", plan],
                 ["runtime.cli", "execute", plan, "--steps", "1", "--checkpoint-dir", checkpoints,
                  "--checkpoint-every", "1"]):
        assert run_here(args).returncode == 0, args
    report = tmp_path / "report.json"
    result = run_here(["runtime.cli", "execute", plan, "--steps", "1", "--resume", "--checkpoint-dir", checkpoints,
                       "--report", str(report)])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "has completed 1 steps" in result.stderr and "give --steps above 1" in result.stderr
    assert not report.exists()
    # --checkpoint-dir without --checkpoint-every or --resume wrote nothing and said nothing
    alone = run_here(["runtime.cli", "execute", plan, "--steps", "1", "--checkpoint-dir", str(tmp_path / "new")])
    assert alone.returncode == 2 and "alone writes no checkpoint: add --checkpoint-every K" in alone.stderr, alone.stderr
    assert alone.stderr.count("\n") == 1 and not (tmp_path / "new").exists()
    # --resume where no checkpoint is yet (a job's first launch) trains from step 0 and says so
    first = run_here(["runtime.cli", "execute", plan, "--steps", "1", "--resume", "--checkpoint-dir",
                      str(tmp_path / "fresh"), "--checkpoint-every", "1"])
    assert first.returncode == 0 and "no checkpoint in" in first.stderr and "starts at step 0" in first.stderr, \
        first.stderr
    assert (tmp_path / "fresh" / "latest.json").exists()
