"""A model whose code fixes the batch size under torch.export (a Python loop over the samples,
as LLaVA has): profiling or running another micro-batch size is one line naming the size to use."""
import dataclasses

import pytest

from planner.model.capture import CaptureError
from planner.cli.main import main as planner_main
from runtime.stage import build_rank
from tests.support.runs import plan_with, profile_of
from tests.model.test_inplace import QUICK_PROFILE

PER_SAMPLE = "tests.capture_models:per_sample"


def test_profile_and_runtime_refuse_other_batch_sizes(tmp_path, capsys):
    code = planner_main(["profile", PER_SAMPLE, "--micro-batch-sizes", "1,2", *QUICK_PROFILE,
                         "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and not (tmp_path / "p.json").exists()
    assert "fixed PerSample's batch size at 2" in err and "--micro-batch-sizes 2" in err
    profile = profile_of(PER_SAMPLE, sizes=(2,))  # the size export fixed profiles
    assert profile.capture == "export"
    plan = dataclasses.replace(plan_with(profile, [1], 2, 4), micro_batch_size=1, num_micro_batches=4)
    with pytest.raises(CaptureError, match="plan with micro-batch size 2"):
        build_rank(plan, plan.topology(), 0)
