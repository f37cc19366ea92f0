"""The three commands as a user runs them: outputs, exit codes, files, and one-line errors."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.support.runs import ROOT, descendants, max_abs_diff, ranks_left, reference_state, run_cli, run_here


def _no_traceback(result):
    assert "Traceback" not in result.stderr, result.stderr


@pytest.fixture(scope="module")
def gpt_profile(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prof") / "gpt.json")
    result = run_cli(["planner.cli", "profile", "builtin:gpt", "--model-arg", "vocab=4096",
                      "--model-arg", "layers=3", "--micro-batch-sizes", "1,2,4", "--repeats", "1",
                      "--warmup", "0", "--min-time", "0", "--link", "none", "--engine-cost", "none", "-o", path])
    # short: the file's contract, not its times (the timing rules, the link and the engine's cost:
    # tests/profile/test_measure.py)
    assert result.returncode == 0, result.stderr
    assert "unit" in result.stdout and "wrote" in result.stdout  # progress while measuring
    return path


def test_profile_file_contract(gpt_profile):
    with open(gpt_profile) as f:
        profile = json.load(f)
    assert profile["schema_version"] == 1
    assert profile["model"] == {"entry": "builtin:gpt", "args": {"vocab": 4096, "layers": 3}, "seed": 0}
    names = [u["name"] for u in profile["units"]]
    assert names == ["tok_emb", "pos_emb", "blocks.0", "blocks.1", "blocks.2", "ln_f", "head"]
    head = profile["units"][-1]
    assert head["param_bytes"] == 4096 * 64 * 4
    for b in ("1", "2", "4"):
        assert head["forward_s"][b] > 0 and head["backward_s"][b] > 0
    # saved-for-backward bytes grow with the micro-batch
    assert profile["units"][2]["saved_bytes"]["4"] > profile["units"][2]["saved_bytes"]["1"] > 0
    # cut 1 is crossed by the token embeddings (float, grad) alone: the positions (an arange) are
    # computed again by the stage reading them (planner/model/recomputable.py)
    cut1 = profile["cuts"][0]["values"]
    assert [(v["name"], v["requires_grad"]) for v in cut1] == [("tok_emb", True)]
    assert cut1[0]["bytes"]["2"] == 2 * 32 * 64 * 4


def test_end_to_end_profile_solve_execute(gpt_profile, tmp_path):
    plan_path, state_path, report_path = (str(tmp_path / n) for n in ("plan.json", "state.pt", "report.json"))
    solved = run_cli(["planner.cli", "solve", gpt_profile, "--stages", "2", "--global-batch", "8",
                      "--schedule", "1f1b", "-o", plan_path])
    assert solved.returncode == 0, solved.stderr
    assert "proven optimal" in solved.stdout
    with open(plan_path) as f:
        plan = json.load(f)
    for key in ("schema_version", "model", "schedule", "micro_batch_size", "num_micro_batches", "stages",
                "predicted_iteration_s", "solver"):
        assert key in plan
    assert plan["micro_batch_size"] * plan["num_micro_batches"] == 8
    assert set(plan["solver"]) >= {"status", "objective", "bound", "gap", "seconds"}
    ran = run_cli(["runtime.cli", "execute", plan_path, "--steps", "3", "--lr", "0.05",
                   "--save-state", state_path, "--report", report_path])
    assert ran.returncode == 0, ran.stderr
    assert "predicted" in ran.stdout and "measured" in ran.stdout
    with open(report_path) as f:
        report = json.load(f)
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    assert all(s["loss"] > 0 and s["time_s"] > 0 for s in report["steps"])
    assert report["predicted_iteration_s"] == pytest.approx(plan["predicted_iteration_s"])
    assert report["measured_iteration_s"] > 0
    import torch

    from planner.plan.file import load_plan
    state = torch.load(state_path, weights_only=True)
    assert max_abs_diff(state, reference_state(load_plan(plan_path), steps=3, lr=0.05)) <= 1e-5


def test_infeasible_memory_exits_2_with_diagnosis(gpt_profile, tmp_path):
    plan_path = tmp_path / "plan.json"
    result = run_here(["planner.cli", "solve", gpt_profile, "--stages", "2", "--global-batch", "8",
                       "--memory-per-device", "1MiB", "-o", str(plan_path)])
    assert result.returncode == 2
    _no_traceback(result)
    assert not plan_path.exists()
    message = result.stderr
    assert "stage" in message and "MiB" in message
    # the diagnosis names a memory that fits; solving with it succeeds
    import re
    # (--recompute auto: the lesser floor of no recomputation and all, which fits, says which)
    smallest = re.search(r"allow [0-9.]+ [KMG]iB \(([0-9]+) bytes\) per device \(what fits (without recomputation|"
                         r"when recomputing every unit)",
                         message)
    assert smallest, message
    fits = run_here(["planner.cli", "solve", gpt_profile, "--stages", "2", "--global-batch", "8",
                     "--memory-per-device", smallest.group(1), "-o", str(plan_path)])
    assert fits.returncode == 0, fits.stderr


@pytest.mark.parametrize("args,needle", [
    (["planner.cli", "solve", "/nonexistent/profile.json"], "does not exist"),
    (["planner.cli", "profile", "builtin:nope"], "unknown built-in model"),
    (["planner.cli", "profile", "no_such_pkg.mod:fn"], "cannot import"),
    (["planner.cli", "profile", "builtin:mlp", "--model-arg", "oops"], "key=value"),
    (["planner.cli", "profile", "builtin:mlp", "--model-arg", "nonsense=1"], "nonsense"),
    (["runtime.cli", "execute", "/nonexistent/plan.json"], "does not exist"),
    (["planner.cli", "profile", "builtin:mlp", "--model-arg", "dim=-1"], "builtin:mlp: dim=-1 is a size, 0 to"),
    (["planner.cli", "profile", "builtin:mlp", "--min-time", "inf"], "--warmup and --min-time are seconds"),
    (["planner.cli", "profile", "builtin:mlp", "--threads", "100000"], "--threads is torch threads"),
    (["planner.cli", "profile", "tests.models:bad_batch"], "inputs was a Tensor: wrap it, (x,)"),
    (["planner.cli", "profile", "tests.models:bad_batch", "--model-arg", "kind=target"],
     "target has shape (4,); every batch tensor needs the batch (1) on dim 0"),
    # a fuzz of every command: a read that never ended, a traceback, a seed no plan could be run with
    (["planner.cli", "import-pipedream", "/dev/zero", "--batch-size", "1", "-o", "/tmp/never.json"],
     "is not a regular file; pass a graph.txt file"),
    (["planner.cli", "profile", "builtin:mlp", "--seed", "-1"], "--seed is an integer 0 to 2**63 - 1"),
    (["planner.cli", "profile", "builtin:gpt", "--model-arg", "layers=-1"], "layers=-1 is a size, 0 to"),
    (["planner.cli", "profile", "builtin:gpt", "--analytic", "--model-arg", "layers=99999999999999999999999"],
     "is a size, 0 to"),  # never finished building
    (["planner.cli", "profile", "builtin:mlp", "--micro-batch-sizes", "99999999999"], "--micro-batch-sizes needs "
     "integers 1 to"),  # a traceback from the allocator
    # the twenty-sixth session's fuzz: '' wrote the default profile, printed to stdout, or was ignored
    (["planner.cli", "profile", "builtin:mlp", "-o", ""], "argument --output/-o: an empty value"),
    (["planner.cli", "solve", "p.json", "--cluster", ""], "argument --cluster: an empty value"),
    (["runtime.cli", "execute", "p.json", "--report", ""], "argument --report: an empty value"),
    # the twenty-ninth session's fuzz: a profile recording repeats -3, which planner solve refused; options an
    # analytic profile ignored
    (["planner.cli", "profile", "builtin:mlp", "--repeats", "-3"], "--repeats is timed runs per unit, at least 1"),
    (["planner.cli", "profile", "builtin:mlp", "--analytic", "--link", "measure"], "an analytic profile measures"),
    (["planner.cli", "profile", "builtin:mlp", "--analytic", "--ranks-per-host", "2"], "an analytic profile measures"),
    (["planner.cli", "solve", "p.json", "--schedule", "zb-v", "--virtual-stages", "3"],
     "--virtual-stages applies to interleaved and bfs, not --schedule zb-v (it runs 2 stages per device)"),
    (["planner.cli", "compare", "p.json", "--virtual-stages", "4"], "--virtual-stages applies to interleaved and bfs"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    result = run_here(args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    _no_traceback(result)
    assert needle in result.stderr


def test_a_model_module_that_cannot_be_imported_is_one_line(tmp_path):
    (tmp_path / "broken_syntax.py").write_text("def build(:\n    pass\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    for entry, needle in (("broken_syntax:build", "a syntax error in"), ("exits:build", "raised SystemExit: 3")):
        result = run_cli(["planner.cli", "profile", entry], env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
        assert result.returncode == 2 and needle in result.stderr, result.stderr
        _no_traceback(result)


def test_a_batch_function_returning_no_pair_is_one_line(tmp_path):
    # the twenty-ninth session's fuzz: a batch function returning None was a traceback in capture (it unpacks it)
    quick = ["--micro-batch-sizes", "1", "--link", "none", "--engine-cost", "none", "--min-time", "0", "--quiet"]
    for kind, got in (("none", "returned NoneType"), ("three", "returned a tuple of 3")):
        result = run_here(["planner.cli", "profile", "tests.models:odd_batch", "--model-arg", f"kind={kind}", *quick,
                           "-o", str(tmp_path / "no.json")])
        assert result.returncode == 2 and f"the model's batch function {got}, not the pair (inputs, target)" in \
            result.stderr, result.stderr
        assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "no.json").exists()


@pytest.mark.parametrize("main,argv,needle", [
    ("planner", ["solve"], "the following arguments are required: profile"),
    ("planner", [], "the following arguments are required: command"),
    ("planner", ["solve", "p.json", "--schedule", "nope"], "invalid choice: 'nope'"),
    ("runtime", ["execute", "plan.json", "--steps", "x"], "invalid int value: 'x'"),
])
def test_a_usage_mistake_is_one_line_with_where_the_options_are(capsys, main, argv, needle):
    from planner.cli.main import build_parser as planner_parser
    from runtime.cli import build_parser as runtime_parser

    parser = planner_parser() if main == "planner" else runtime_parser()
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and needle in err and "--help` lists the options" in err
    assert err.count("\n") == 1 and "usage:" not in err


def test_bad_memory_size_and_global_batch(gpt_profile, tmp_path):
    bad = run_here(["planner.cli", "solve", gpt_profile, "--memory-per-device", "lots"])
    assert bad.returncode == 2 and "16GiB" in bad.stderr
    _no_traceback(bad)
    odd = run_here(["planner.cli", "solve", gpt_profile, "--global-batch", "-8", "-o", str(tmp_path / "p.json")])
    assert odd.returncode == 2 and "--global-batch" in odd.stderr
    _no_traceback(odd)


@pytest.mark.parametrize("extra,needle", [
    (["--latency", "nan"], "--latency is seconds per message, 0 to 3600"),
    (["--message-cost", "1e300"], "--message-cost is seconds per message"),
    (["--bandwidth", "1e-300"], "--bandwidth must be 1 byte to 1e+18"),
    (["--memory-per-device", "1e400"], "--memory-per-device must be 1 byte to 1e+18"),
    (["--global-batch", "10000000"], "more than 4096 micro-batches per replica"),
    (["-o", ""], "argument --output/-o: an empty value"),
    (["--gap", "1.5"], "--gap is a share of the iteration time"),
    (["--gap", "0.01", "--method", "dp"], "--gap applies to --method ilp only"),
    (["--time-limit", "-1"], "--time-limit is seconds, more than 0"),
    (["--time-limit", "nan"], "--time-limit is seconds, more than 0"),
])
def test_solve_numbers_out_of_range_are_refused_before_the_search(gpt_profile, tmp_path, extra, needle):
    result = run_here(["planner.cli", "solve", gpt_profile, "--stages", "2", "-o", str(tmp_path / "p.json"), *extra])
    assert result.returncode == 2 and needle in result.stderr, result.stderr
    _no_traceback(result)
    assert not (tmp_path / "p.json").exists()


def test_an_output_that_is_a_folder_is_refused_before_the_work(gpt_profile, tmp_path):
    (tmp_path / "out").mkdir()
    for args in (["planner.cli", "solve", gpt_profile, "-o", str(tmp_path / "out")],
                 ["planner.cli", "profile", "builtin:mlp", "-o", str(tmp_path / "out")]):
        result = run_here(args)
        assert result.returncode == 2 and "is a directory; name a file to write" in result.stderr, result.stderr
        assert result.stdout == ""  # refused before any work (nothing measured, nothing solved)
        _no_traceback(result)


def test_plan_for_a_changed_model_is_refused(gpt_profile, tmp_path):
    plan_path = str(tmp_path / "plan.json")
    assert run_here(["planner.cli", "solve", gpt_profile, "--global-batch", "8", "-o", plan_path]).returncode == 0
    with open(plan_path) as f:
        plan = json.load(f)
    plan["model"]["args"]["layers"] = 5  # the graph now has more units than the plan
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    result = run_here(["runtime.cli", "execute", plan_path, "--steps", "1"])
    assert result.returncode != 0
    assert "re-run `planner profile`" in result.stderr
    _no_traceback(result)
    # the same count, a unit renamed by hand: its names (the twenty-ninth session's fuzz: "the model's graph has
    # 6 units but the plan names 6, first difference at unit 0")
    plan["model"]["args"]["layers"] = gpt_layers = json.load(open(gpt_profile))["model"]["args"].get("layers", 2)
    first = plan["stages"][0]["units"][0]
    plan["stages"][0]["units"][0] = "renamed"
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    result = run_here(["runtime.cli", "execute", plan_path, "--steps", "1"])
    assert result.returncode != 0 and f"unit 0 is {first!r} in the graph and 'renamed' in the plan" in result.stderr, \
        (gpt_layers, result.stderr)


def test_a_script_without_a_main_guard_is_told_why_its_ranks_stop(tmp_path):
    # the ranks start from a fork server, which imports the calling script again: they died before
    # the worker with only "exited with code 1 before reporting an error"
    from planner.plan.file import save_plan
    from tests.support.runs import ROOT, plan_with, profile_of

    plan_path, script = str(tmp_path / "plan.json"), tmp_path / "train.py"
    save_plan(plan_with(profile_of("builtin:mlp"), [2], 2, 4), plan_path)
    script.write_text("import sys\nfrom runtime.cli import main\nsys.exit(main(['execute', sys.argv[1], '--steps', '1']))\n")
    result = subprocess.run([sys.executable, str(script), plan_path], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert result.returncode == 1 and 'if __name__ == "__main__":' in result.stderr, result.stderr


def test_failing_rank_takes_the_others_down(tmp_path):
    from planner.plan.file import save_plan
    from tests.support.runs import plan_with, profile_of

    plan = plan_with(profile_of("tests.models:failing"), [2], 2, 4)
    plan_path = str(tmp_path / "plan.json")
    save_plan(plan, plan_path)
    start = time.monotonic()
    result = run_here(["runtime.cli", "execute", plan_path, "--steps", "3", "--timeout", "60"])
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "rank 1 failed" in result.stderr and "injected failure in the loss" in result.stderr
    assert result.stderr.count("injected failure") == 1  # printed once
    _no_traceback(result)
    assert elapsed < 30  # the waiting rank was stopped, not left to time out
    assert ranks_left() == []


@pytest.mark.parametrize("launch", ["forkserver", "subprocess"])
def test_ranks_end_with_a_runtime_execute_killed_by_sigkill(tmp_path, launch):
    import signal
    import subprocess
    import sys

    from planner.plan.file import save_plan
    from tests.support.runs import ROOT, plan_with, profile_of

    plan_path = str(tmp_path / "plan.json")
    save_plan(plan_with(profile_of("tests.models:sequential"), [2], 2, 4), plan_path)
    # TMPDIR: the killed command's folder for its ranks' files lands in tmp_path
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PIPEPLANNER_LAUNCH=launch, TMPDIR=str(tmp_path))
    command = subprocess.Popen([sys.executable, "-m", "runtime.cli", "execute", plan_path, "--steps", "1000000"],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("runtime-*/rank1.log")) and time.monotonic() < deadline:
            time.sleep(0.1)  # the ranks have started
        if launch == "subprocess":  # killed while the ranks still import torch, before they ask to end with it
            while len(descendants(command.pid)) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            time.sleep(2.0)  # and are training
        below = descendants(command.pid)
        assert len(below) >= 2, below
        command.kill()
        command.wait(10)
        deadline = time.monotonic() + 60  # ranks still importing torch on a loaded machine end after it
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") and
                                                  not _zombie(pid) for pid in below):
            time.sleep(0.1)
        assert not [pid for pid in below if os.path.exists(f"/proc/{pid}") and not _zombie(pid)]
    finally:
        command.kill()
        for pid in descendants(command.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_solve_replicate(gpt_profile, tmp_path):
    plan_path = tmp_path / "plan.json"
    result = run_here(["planner.cli", "solve", gpt_profile, "--stages", "3", "--replicate", "--global-batch", "8",
                       "-o", str(plan_path)])
    assert result.returncode == 0, result.stderr
    assert ("proven optimal" in result.stdout or "best found, gap" in result.stdout) and re.search(r"\[replicas/(python|enumeration), ", result.stdout)
    with open(plan_path) as f:
        plan = json.load(f)
    replicas = [st.get("replicas", 1) for st in plan["stages"]]
    assert sum(replicas) == plan["pipeline_stages"] == 3
    help_text = run_here(["planner.cli", "solve", "--help"]).stdout
    assert "--replicate" in help_text


@pytest.mark.parametrize("extra,needle", [
    (["--schedule", "interleaved"], "1f1b, gpipe or auto"),
    (["--method", "dp"], "drop --method"),
    (["--gap", "0.01"], "drop --gap"),
])
def test_solve_replicate_refusals_are_one_line(gpt_profile, tmp_path, extra, needle):
    result = run_here(["planner.cli", "solve", gpt_profile, "--stages", "3", "--replicate", "--global-batch", "8",
                       "-o", str(tmp_path / "plan.json")] + extra)
    assert result.returncode == 2, (result.stdout, result.stderr)
    _no_traceback(result)
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_user_errors_are_one_line_and_exit_2_unless_a_traceback_is_asked_for(capsys, monkeypatch):
    import argparse

    from planner.errors import run_subcommand

    def fails(_args):
        raise ValueError("the cost model cannot take this")

    args = argparse.Namespace(func=fails)
    monkeypatch.delenv("PLANNER_TRACEBACK", raising=False)
    assert run_subcommand(args, (ValueError,), "interrupted") == 2
    assert capsys.readouterr().err == "error: the cost model cannot take this\n"

    def interrupted(_args):
        raise KeyboardInterrupt

    assert run_subcommand(argparse.Namespace(func=interrupted), (ValueError,), "interrupted") == 130
    monkeypatch.setenv("PLANNER_TRACEBACK", "1")
    with pytest.raises(ValueError, match="cannot take"):
        run_subcommand(args, (ValueError,), "interrupted")
    with pytest.raises(KeyError):  # not a user error: never swallowed
        run_subcommand(argparse.Namespace(func=lambda _a: {}["x"]), (ValueError,), "interrupted")


def test_a_batch_or_loss_function_that_exits_is_one_line(tmp_path):
    # sys.exit in the model's own functions: a batch's was a traceback (capture calls it), a loss's
    # ended the profile silently with its code, and a rank's batch one at step 2 took the run down
    quick = ["--micro-batch-sizes", "1", "--link", "none", "--engine-cost", "none", "--min-time", "0", "--quiet"]
    for where, needle in (("loss", "the loss function raised ModelExit: the model's loss function called sys.exit(3)"),
                          ("batch", "the model's batch function called sys.exit(3) (batch size 2, step 0)")):
        result = run_here(["planner.cli", "profile", "tests.models:exits", "--model-arg", f"where={where}", *quick,
                           "-o", str(tmp_path / "no.json")])
        assert result.returncode == 2 and needle in result.stderr, result.stderr
        assert len(result.stderr.splitlines()) == 1 and not (tmp_path / "no.json").exists()
    profile, plan = str(tmp_path / "p.json"), str(tmp_path / "plan.json")
    assert run_here(["planner.cli", "profile", "tests.models:exits", "--model-arg", "where=batch", "--model-arg",
                     "step=2", *quick, "-o", profile]).returncode == 0
    solved = run_here(["planner.cli", "solve", profile, "--stages", "2", "--global-batch", "2", "-o", plan])
    assert solved.returncode == 0, solved.stderr
    ran = run_here(["runtime.cli", "execute", plan, "--steps", "4"])
    assert ran.returncode == 1 and "step 2/4" in ran.stdout and "step 3/4" not in ran.stdout
    assert re.search(r"rank [01] failed: ModelEntryError: the model's batch function called sys\.exit\(3\) \(batch "
                     r"size 2, step 2\)", ran.stderr), ran.stderr  # each rank makes the batch: either fails first


def test_an_output_pipe_closed_early_is_one_line_not_a_traceback():
    # `planner profile ... | head -3`: the reader leaves, the next print raised BrokenPipeError
    code = ("import argparse, sys, time\n"
            "from planner.errors import run_subcommand\n"
            "def talks(_args):\n"
            "    while True:\n"
            "        print('progress ' * 100, flush=True)\n"
            "sys.exit(run_subcommand(argparse.Namespace(func=talks), (ValueError,), 'interrupted'))")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    child.stdout.readline()
    child.stdout.close()
    err = child.stderr.read()
    assert child.wait(timeout=60) == 141
    assert err == "stopped: the command reading this output closed it\n"


def test_rank_timeout_has_one_default():
    # runtime execute passes its --timeout to every rank; a torchrun-launched worker gets the same default
    from runtime.cli import build_parser
    from runtime.options import RANK_TIMEOUT_S
    from runtime.worker import _parse

    execute_default = build_parser().parse_args(["execute", "plan.json"]).timeout
    assert execute_default == _parse(["plan.json"]).timeout == RANK_TIMEOUT_S


def _profile_json(tmp_path, mutate=None):
    """A small valid profile file (3 units, sizes 1 and 2, a tied weight, a measured link), mutated."""
    from planner.jsonio import write_json_atomic
    from tests.support.synthetic import synthetic_profile

    profile = synthetic_profile(forward=[1e-3, 2e-3, 1e-3], backward=[2e-3, 4e-3, 2e-3], params=[400, 800, 400],
                                saved=[1000, 2000, 1000], cut_act=[256, 256], sizes=(1, 2))
    data = json.loads(json.dumps(profile.to_json()))
    data["shared_parameters"] = [{"name": "w", "names": ["a.w", "c.w"], "units": ["u0", "u2"], "bytes": 400}]
    data["link"] = {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}
    if mutate is not None:
        mutate(data)
    path = str(tmp_path / "profile.json")
    write_json_atomic(path, data)
    if any(isinstance(x, float) and x != x for x in _leaves(data)):  # NaN: JSON writers refuse it, json.dump allows
        with open(path, "w") as f:
            json.dump(data, f)
    return path


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


def _set(path, value):
    def mutate(data):
        *keys, last = path
        target = data
        for key in keys:
            target = target[key]
        if value is _DELETE:
            del target[last]
        else:
            target[last] = value
    return mutate


_DELETE = object()

BAD_PROFILES = [
    # (what is wrong, the field the error names first)
    (_set(["units", 1, "forward_s", "2"], -0.1), 'units[1].forward_s["2"] is -0.1: times must be finite, >= 0'),
    (_set(["units", 0, "backward_s", "1"], float("nan")), 'units[0].backward_s["1"] is NaN'),
    (_set(["units", 2, "forward_s", "1"], None), 'units[2].forward_s["1"] is null'),  # how inf is written
    (_set(["units", 0, "forward_s", "1"], "fast"), 'units[0].forward_s["1"] is "fast"'),
    (_set(["units", 1, "saved_bytes", "1"], -5), 'units[1].saved_bytes["1"] is -5: byte counts must be'),
    (_set(["units", 2, "param_bytes"], -400), "units[2].param_bytes is -400"),
    # read as 0 before (int() of 0.5), and threads / repeats said "byte counts" (the last fuzz's minor list)
    (_set(["units", 1, "saved_bytes", "1"], 0.5), 'units[1].saved_bytes["1"] is 0.5: byte counts must be whole numbers'),
    (_set(["repeats"], 2.5), "repeats is 2.5: repeat counts must be whole numbers"),
    (_set(["threads"], -1), "threads is -1: thread counts must be whole numbers"),
    (_set(["units", 2, "param_bytes"], 10 ** 400), "units[2].param_bytes is 1000"),  # no float holds it
    (_set(["units", 1, "saved_bytes", "1"], 1e300),
     'units[1].saved_bytes["1"] is 1e+300: byte counts must be whole numbers >= 0 and at most'),
    (_set(["link", "latency_s"], 1e20), "link.latency_s is 1e+20: times must be finite, >= 0 and at most 1e+06"),
    (_set(["units", 0, "nodes"], 5), "units[0].nodes is 5: expected a list of node names"),
    (_set(["units", 0, "optimizer_s"], {"sgd": -1e-3}), 'units[0].optimizer_s["sgd"] is -0.001'),
    (_set(["units", 2, "backward_s", "2"], _DELETE), "units[2].backward_s has no entry for micro-batch size 2"),
    (_set(["units", 1, "name"], "u0"), "units[1].name 'u0' repeats units[0].name"),
    (_set(["micro_batch_sizes"], [1, 0]), "micro_batch_sizes is [1, 0]"),
    (_set(["cuts", 0, "before_unit"], 2), "cuts[0].before_unit is 2"),
    (lambda d: d["cuts"].pop(), "cuts has 1 entries: 3 units have 2 cuts"),
    (_set(["cuts", 1, "values", 0, "bytes", "1"], -256), 'cuts[1].values[0].bytes["1"] is -256'),
    (_set(["cuts", 0, "values", 0, "bytes", "2"], _DELETE),
     "cuts[0].values[0].bytes has no entry for micro-batch size 2"),
    (_set(["cuts", 0, "values", 0, "kind"], "blob"), "cuts[0].values[0].kind is \"blob\""),
    (_set(["stage_overhead_s"], {"1": {"forward": -1e-4, "backward": 0.0}}),
     'stage_overhead_s["1"].forward is -0.0001'),
    (_set(["shared_parameters", 0, "bytes"], -400), "shared_parameters[0].bytes is -400"),
    (_set(["shared_parameters", 0, "units"], ["u0", "head"]), "shared_parameters[0].units is [\"u0\", \"head\"]"),
    # a solver fuzz's profile: ties bigger than a unit's parameters, which count them (the program went infeasible)
    (_set(["shared_parameters", 0, "bytes"], 500), "shared_parameters[0].bytes brings the tied parameters unit 'u0'"),
    (_set(["link", "bandwidth_bytes_per_s"], -1e9), "link.bandwidth_bytes_per_s is -1000000000.0"),
    (_set(["link", "latency_s"], -1e-4), "link.latency_s is -0.0001"),
    (_set(["link", "message_s"], -1e-6), "link.message_s is -1e-06"),
    (_set(["link", "allreduce"], {"bandwidth_bytes_per_s": 0}), "link.allreduce.bandwidth_bytes_per_s is 0"),
    (_set(["link", "allreduce"], [1]), "link.allreduce is [1]"),
    (_set(["link", "rhythm"], {"latency_s": -1e-3, "forward_s": 1e-3, "backward_s": 1e-3}),
     "link.rhythm.latency_s is -0.001"),
    (_set(["link", "rhythm"], "fast"), "link.rhythm is \"fast\""),
    (_set(["link", "rhythm"], {"latency_s": 1e-3, "forward_s": 1e-3, "backward_s": 1e-3, "message_s": -1e-5}),
     "link.rhythm.message_s is -1e-05"),
    (_set(["link", "transport_message_s"], -1e-6), "link.transport_message_s is -1e-06"),
    (_set(["model"], "x"), "model is \"x\""),
    # a fuzz of every command: each solved, and the run then failed on a rank (or was told to solve again)
    (_set(["model", "seed"], -1), "model.seed is -1, not an integer >= 0"),
    (_set(["model", "entry"], 5), "model.entry is 5, not a model entry"),
    (_set(["cuts", 0, "values", 0, "dtype"], "float33"), 'cuts[0].values[0].dtype is "float33": expected one of'),
    (_set(["cuts", 0, "values", 0, "requires_grad"], "yes"), 'cuts[0].values[0].requires_grad is "yes"'),
    (_set(["measured_under"], "x"), "measured_under is \"x\""),
    (_set(["measured_under"], {"host_kernel": {"mean_s": -1.0}}), "measured_under.host_kernel.mean_s is -1.0"),
    (_set(["measured_under"], {"flush_subnormals": "yes"}), 'measured_under.flush_subnormals is "yes"'),
    (_set(["units", 0, "backward_weight_s"], {"1": 1e-3, "2": 1e-3}), "units[0].backward_input_s is missing"),
    (lambda d: d["units"][1].update(backward_input_s={"1": 1e-3, "2": 1e-3}, backward_weight_s={"1": -1e-3, "2": 1e-3},
                                    weight_held_bytes={"1": 0, "2": 0}), 'units[1].backward_weight_s["1"] is -0.001'),
    # the twenty-sixth session's fuzz: tracebacks in solve and calibrate, a plan its own reader refused
    (_set(["dtype"], ["float32"]), 'dtype is ["float32"]: expected one of float32'),
    (_set(["dtype"], "zzz"), 'dtype is "zzz": expected one of'),
    (lambda d: d.update(calibration={"runs": 1e300}), "calibration.runs is 1e+300"),
    (lambda d: d.update(calibration={"runs": 1.5}), "calibration.runs is 1.5"),
    (_set(["analytic"], "x"), 'analytic is "x"'),
    (_set(["analytic"], {"device_spec": {"reserve_bytes": -1e30}}), "analytic.device_spec.reserve_bytes is -1e+30"),
    (_set(["analytic"], {"device_spec": {"reserve_bytes": [1]}}), "analytic.device_spec.reserve_bytes is [1]"),
    # the twenty-ninth session's fuzz: solved, and the plan written was refused by every reader of plans
    (_set(["torch_version"], [1, 2]), "torch_version is [1, 2]: expected a version string"),
    (_set(["model", "args"], None), "model.args is null: expected an object"),
]


@pytest.mark.parametrize("mutate,field", BAD_PROFILES, ids=[f[1].split(" is")[0].split(" has")[0].split(" repeats")[0]
                                                            for f in BAD_PROFILES])
def test_bad_profile_is_one_line_exit_2_nothing_written(tmp_path, capsys, monkeypatch, mutate, field):
    from planner.cli.main import main

    monkeypatch.delenv("PLANNER_TRACEBACK", raising=False)
    good, out = _profile_json(tmp_path / "good"), tmp_path / "plan.json"
    assert main(["solve", good, "--global-batch", "4", "-o", str(out)]) == 0 and out.exists()  # the file before harm
    out.unlink()
    capsys.readouterr()
    bad = _profile_json(tmp_path, mutate)
    for command in (["solve", bad, "--global-batch", "4", "-o", str(out)],
                    ["compare", bad, "--global-batch", "4"],
                    ["calibrate", bad, str(tmp_path / "report.json"), "--plan", str(tmp_path / "p.json"),
                     "-o", str(tmp_path / "calibrated.json")]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: profile {bad!r}: {field}"), err
        assert "re-run `planner profile`" in err
    assert not out.exists() and not (tmp_path / "calibrated.json").exists()


def test_a_profile_whose_tables_would_not_fit_is_refused_before_building_them(tmp_path, monkeypatch):
    # 20,000 units: the search's tables grew to 25 GB with no output (killed, or the host swapping)
    from planner.solve import api

    profile, out = _profile_json(tmp_path), tmp_path / "plan.json"
    monkeypatch.setattr(api, "available_memory", lambda: 1000)  # 80 bytes x 9 ranges fit, not 80 x (3 + 1)^2
    result = run_here(["planner.cli", "solve", profile, "--stages", "2", "--global-batch", "4", "-o", str(out)])
    assert result.returncode == 2 and not out.exists()
    assert result.stderr == ("error: the profile has 3 units: the search's tables of every unit range need about "
                             "1.2 KiB, and this host has 1000 B free; solve where more memory is free, or profile "
                             "the model as at most 2 units (larger units: docs/profile.md, \"How many units\")\n")
    monkeypatch.setattr(api, "available_memory", lambda: None)  # not known: no check
    assert run_here(["planner.cli", "solve", profile, "--stages", "2", "--global-batch", "4", "-o",
                     str(out)]).returncode == 0
    with pytest.raises(ValueError, match="20,000 units: .* need about 29.81 GiB.* at most 14,653 units"):
        api.check_table_room(20000, available=16 << 30)


def test_negative_costs_are_refused_by_planner_solve(tmp_path):
    def negative(data):
        for unit in data["units"]:
            unit["forward_s"] = {b: -t for b, t in unit["forward_s"].items()}
            unit["saved_bytes"] = {b: -n for b, n in unit["saved_bytes"].items()}

    bad, out = _profile_json(tmp_path, negative), tmp_path / "plan.json"
    result = run_here(["planner.cli", "solve", bad, "--global-batch", "4", "-o", str(out)])
    assert result.returncode == 2 and not out.exists(), result.stdout
    _no_traceback(result)
    assert result.stderr.splitlines() == [f"error: profile {bad!r}: units[0].forward_s[\"1\"] is -0.001: times must "
                                          "be finite, >= 0 and at most 1e+06; re-run `planner profile`"]


def _without_highspy(argv):
    """`planner ARGV` in a process where `import highspy` fails (as in an install without it)."""
    import subprocess
    import sys

    from tests.support.runs import ROOT

    code = ("import sys; sys.modules['highspy'] = None\n"
            "from planner.cli.main import main\n"
            f"sys.exit(main({list(argv)!r}))")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)


def test_solve_without_highspy_falls_back_to_cbc(tmp_path):
    # tied weights send the solve to the integer program (the chain DP does not take them)
    profile, with_highs, without = _profile_json(tmp_path), tmp_path / "highs.json", tmp_path / "cbc.json"
    problem = ["--stages", "2", "--global-batch", "4"]
    assert run_here(["planner.cli", "solve", profile, *problem, "-o", str(with_highs)]).returncode == 0
    result = _without_highspy(["solve", profile, *problem, "-o", str(without)])
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["note: highspy cannot be imported here (it comes with pipeplanner: "
                                          "reinstall, or pip install highspy), so the integer program runs on CBC, "
                                          "pulp's bundled solver, which is slower"]
    plans = [json.load(open(p)) for p in (with_highs, without)]
    assert [p["solver"]["method"] for p in plans] == ["ilp", "ilp"]
    assert [p["solver"]["backend"] for p in plans] == ["highs", "cbc"]
    assert plans[1]["solver"]["status"] == "optimal" and "proven optimal" in result.stdout
    assert plans[1]["predicted_iteration_s"] == pytest.approx(plans[0]["predicted_iteration_s"], rel=1e-9)
    # HiGHS asked for by name is not replaced
    named = _without_highspy(["solve", profile, *problem, "--backend", "highs", "-o", str(tmp_path / "no.json")])
    assert named.returncode == 2 and not (tmp_path / "no.json").exists()
    assert named.stderr.splitlines() == ["error: the highs backend needs highspy, which cannot be imported here: "
                                         "pip install highspy, or use --backend cbc"]


def test_a_plain_install_brings_the_default_solver():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    from tests.support.runs import ROOT

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]]
    assert "highspy" in names and "pulp" in names  # HiGHS is the default backend: not an extra


def test_the_measured_per_message_cost_reaches_the_plan(tmp_path):
    """A profile's measured link carries `message_s`; the plan charges it on every message (each
    batch waits that long per operation) unless --message-cost overrides it."""
    from planner.plan.file import load_plan

    def profile_with_link(data):
        data["link"] = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9, "message_s": 2e-4}

    profile = _profile_json(tmp_path, profile_with_link)
    plans = {}
    for name, extra in (("measured", []), ("none", ["--message-cost", "0"])):
        out = tmp_path / f"{name}.json"
        result = run_here(["planner.cli", "solve", profile, "--stages", "2", "--global-batch", "4", "-o", str(out)]
                          + extra)
        assert result.returncode == 0, result.stderr
        plans[name] = load_plan(str(out))
    assert plans["measured"].message_s == 2e-4 and plans["none"].message_s == 0.0
    assert plans["measured"].predicted_iteration_s > plans["none"].predicted_iteration_s
    bad = run_here(["planner.cli", "solve", profile, "--message-cost", "-1", "-o", str(tmp_path / "x.json")])
    assert bad.returncode == 2 and "--message-cost" in bad.stderr


def test_solve_reads_the_balanced_rhythm_as_an_upper_reading(tmp_path, capsys):
    """A profile whose link records the rhythm (planner.profile.rhythm) keeps the ping-pong's
    latency in the plan, and `planner solve` says what the step would take if every message waited
    the rhythm's latency (the same split evaluated with it: longer the longer the wait). Not with the
    user's own --latency."""
    import re

    from planner.cli.main import main
    from planner.plan.file import load_plan

    def solved(rhythm_latency, extra=(), rhythm_message_s=None):
        def with_rhythm(data):
            data["link"] = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9, "message_s": rhythm_message_s or 0.0,
                            "rhythm": {"forward_s": 1e-3, "backward_s": 2e-3, "micro_batches": 8, "steps": 5,
                                       "step_s": 0.05, "latency_s": rhythm_latency}}
            if rhythm_message_s is not None:
                data["link"]["rhythm"]["message_s"] = rhythm_message_s

        folder = tmp_path / f"{rhythm_latency}-{rhythm_message_s}"
        profile, out = _profile_json(folder, with_rhythm), folder / "plan.json"
        assert main(["solve", profile, "--stages", "2", "--global-batch", "4", "-o", str(out), *extra]) == 0
        lines = [l for l in capsys.readouterr().out.splitlines() if "between two balanced stages" in l]
        return load_plan(str(out)), lines

    plan, lines = solved(5e-3)
    assert plan.latency_s == 1e-5 and len(lines) == 1  # recorded, not charged
    slow, percent = re.search(r"would take ([0-9.]+) ms \(\+([0-9]+)%\)", lines[0]).groups()
    assert "5000 us" in lines[0] and float(slow) > plan.predicted_iteration_s * 1e3 * 1.05
    assert int(percent) == round(100 * (float(slow) / (plan.predicted_iteration_s * 1e3) - 1))
    _, longer = solved(1e-2)
    assert float(re.search(r"would take ([0-9.]+) ms", longer[0]).group(1)) > float(slow)
    assert solved(5e-3, ["--latency", "1e-5"])[1] == []
    # a rhythm read into the per-message cost the plan charges (link.rhythm.message_s): no second reading
    assert solved(5e-3, rhythm_message_s=4e-5)[1] == []


def test_pictures_are_written_where_named_and_never_over_the_plan(tmp_path):
    # the twenty-ninth session's fuzz: a --png/--timeline path without a suffix got an empty file (matplotlib added
    # ".png" to the temporary file, left beside it), one naming the plan replaced it with a picture, and a suffix
    # matplotlib does not write was its own message after the work (after training, for runtime execute)
    plan = str(tmp_path / "plan.png")
    assert run_here(["planner.cli", "solve", "tests/data/zero_bubble_recompute_profile.json", "--stages", "2",
                     "--quiet", "-o", plan]).returncode == 0
    before = open(plan, "rb").read()
    for command, option in (("show", "--png"), ("simulate", "--timeline")):
        picture = tmp_path / f"{command}-picture"
        assert run_here(["planner.cli", command, option, str(picture), plan]).returncode == 0
        assert open(picture, "rb").read(4) == b"\x89PNG"
        for path, needle in ((plan, "which this command reads"), (str(tmp_path / "p.txt"), "writes no .txt picture")):
            result = run_here(["planner.cli", command, option, path, plan])
            assert result.returncode == 2 and needle in result.stderr and result.stderr.count("\n") == 1, result.stderr
            assert result.stdout == ""  # refused before the work
    ran = run_here(["runtime.cli", "execute", plan, "--timeline", str(tmp_path / "t.txt")])
    assert ran.returncode == 2 and "--timeline" in ran.stderr and "writes no .txt picture" in ran.stderr, ran.stderr
    assert open(plan, "rb").read() == before and not list(tmp_path.glob(".tmp-*"))
    assert not (tmp_path / "p.txt").exists() and not (tmp_path / "t.txt").exists()


@pytest.mark.parametrize("flags, v", [(["--schedule", "auto"], None), (["--schedule", "auto", "--virtual-stages", "3"], 3),
                                      (["--schedule", "interleaved"], 2), (["--schedule", "bfs", "--virtual-stages", "4"], 4)])
def test_schedule_auto_compares_the_stages_per_device(gpt_profile, tmp_path, monkeypatch, flags, v):
    """--schedule auto leaves v to the search (2, 3 and 4: planner.solve.search.VIRTUAL_STAGES), as issue 18 asks
    of the choice; it planned interleaved and bfs with --virtual-stages' default 2 alone."""
    import planner.solve.api as api
    from planner.cli.main import main

    seen = []
    real = api.solve

    def spy(*args, **kwargs):
        seen.append(kwargs.get("virtual_stages"))
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "solve", spy)
    assert main(["solve", gpt_profile, "--devices", "2", "--global-batch", "8", "--time-limit", "10", *flags,
                 "-o", str(tmp_path / "plan.json")]) == 0
    assert seen == [v]
