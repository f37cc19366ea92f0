"""`runtime execute --engine torch`: the plan's stages in torch.distributed.pipelining's PipelineStage,
run by torch's schedule classes, train exactly like one process (2 steps, max abs diff <= 1e-5 fp32):
a skip over a stage with two outputs and a tuple target (1F1B), interleaved with 2 data-parallel replicas
and a recomputed unit, a tied-weight Hugging Face Llama (looped BFS), ZB-V (also behind a frozen front
and with views for outputs). What torch cannot run is refused in one line before any rank starts."""
import dataclasses
import json
import os

import pytest

from runtime.cli import main as runtime_main
from tests.support.runs import (execute, max_abs_diff, plan_with, profile_of, reference_state, report_of,
                                reshape_plan)

LLAMA_TIED = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "seq_len": 8, "tie_word_embeddings": True}


def _plan(case):
    if case == "two-outputs-skip":  # a tuple output, a tuple target; the auxiliary output skips stage 1
        return plan_with(profile_of("tests.models:two_outputs"), [2, 4], 2, 8, "1f1b")
    if case == "interleaved-dp2":  # 4 stages on 2 ranks x 2 replicas; an int tensor crosses cut 1; recomputation
        return reshape_plan(plan_with(profile_of("builtin:gpt"), [1, 3, 6], 2, 8, "gpipe"), virtual_stages=2,
                            data_parallel=2, schedule="interleaved", recompute={1: ["blocks.0"]})
    if case == "zb-v":  # torch's ScheduleZBVZeroBubble on the V placement: rank 0 runs stages 0 and 3
        return plan_with(profile_of("builtin:gpt", {"layers": 6}), [2, 5, 7], 2, 8, "zb-v")
    if case == "zb-v-frozen-front":  # stage 1's input needs no gradient: torch's weight part found no weights
        return plan_with(profile_of("tests.models:frozen_layers"), [1, 2, 3], 2, 4, "zb-v")
    if case == "zb-v-view-outputs":  # torch's input part detaches the outputs in place: views refused it
        return plan_with(profile_of("tests.models:view_outputs"), [1, 2, 3], 2, 6, "zb-v")
    if case == "zb-v-saved-and-sent":  # ... and a value stage 1 saved and sent broke its weight part (sweep 29)
        return plan_with(profile_of("tests.capture_models:saved_and_sent", sizes=(2,)), [1, 3, 4], 2, 4, "zb-v")
    if case == "zb-v-cat-inputs":  # ... and stage 2's input gradients, views of its concatenation's, stopped gloo (sweep 30)
        return plan_with(profile_of("tests.capture_models:cat_inputs", sizes=(2,)), [1, 2, 3], 2, 4, "zb-v")
    if case == "zb-v-late-embedding":  # ... and stage 1's embedding, reached from the ids alone, never moved (sweep 30)
        return plan_with(profile_of("tests.capture_models:late_embedding", sizes=(2,)), [1, 2, 3], 2, 4, "zb-v")
    if case == "zb-v-seq2seq":  # ... and stage 2's weight part, two of torch's param groups sharing nodes, stopped
        return plan_with(profile_of("tests.capture_models:seq2seq", sizes=(2,)), [2, 3, 5], 2, 4, "zb-v")
    pytest.importorskip("transformers")  # "hf-tied-bfs": the embedding (stage 0) is the LM head (stage 3)
    profile = profile_of("hf:LlamaForCausalLM", LLAMA_TIED, sizes=(2,))  # as tests/model/test_hf.py: one profile
    return reshape_plan(plan_with(profile, [1, 3, 5], 2, 4, "gpipe"), virtual_stages=2, schedule="bfs")


@pytest.mark.parametrize("case", ["two-outputs-skip", "interleaved-dp2", "hf-tied-bfs", "zb-v", "zb-v-frozen-front",
                                  "zb-v-view-outputs", "zb-v-saved-and-sent", "zb-v-cat-inputs",
                                  "zb-v-late-embedding", "zb-v-seq2seq"])
def test_torch_engine_trains_like_one_process(tmp_path, case):
    plan = _plan(case)
    losses = []
    # SGD momentum and clipping by the global norm, as the own engine applies them
    training = {"momentum": 0.9, "clip_grad_norm": 0.5} if case == "two-outputs-skip" else {}
    flags = ["--momentum", "0.9", "--clip-grad-norm", "0.5"] if training else []
    state = execute(plan, tmp_path, steps=2, extra=["--engine", "torch", *flags])
    assert max_abs_diff(state, reference_state(plan, steps=2, losses=losses, training=training)) <= 1e-5
    report = report_of(tmp_path)
    assert report["engine"] == "torch" and report["schedule"] == plan.schedule
    assert [s["loss"] for s in report["steps"]] == pytest.approx(losses, rel=1e-5)
    assert all(s["measured"]["forward_s"] > 0 and s["measured"]["backward_s"] > 0 for s in report["stages"])
    if case == "hf-tied-bfs":
        assert (state["lm_head.weight"] == state["model.embed_tokens.weight"]).all()
    if case == "two-outputs-skip":
        assert "passed through them" in open(os.path.join(str(tmp_path), "execute.out")).read()


def _refused(tmp_path, plan, *extra):
    path = os.path.join(str(tmp_path), "plan.json")
    with open(path, "w") as f:
        json.dump(plan.to_json(), f)
    return runtime_main(["execute", path, "--engine", "torch", *extra])


def test_refusals_are_one_line_before_any_rank_starts(tmp_path, capsys):
    base = plan_with(profile_of("tests.models:tied_lm"), [2], 2, 8, "1f1b")
    cases = [(reshape_plan(base, replicas=[1, 2]), (), "replicated stages"),
             (dataclasses.replace(base, precision="bf16-mixed"), (), "fp32 plans only"),
             (dataclasses.replace(base, emulated_boundaries=[0]), (), "emulated slow link"),
             # torch's schedule classes refused these counts as each rank built them ("rank 1 failed: ValueError:
             # Number of microbatches (2) must be greater than or equal to the number of stages (3)")
             (plan_with(profile_of("tests.models:tied_lm"), [1, 2], 4, 8, "1f1b"), (), "needs at least as many micro-batches as stages")]
    for plan, extra, cause in cases:
        assert _refused(tmp_path, plan, *extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and cause in err and "--engine own" in err, err
    assert not [n for n in os.listdir(str(tmp_path)) if n != "plan.json"]


def test_a_torch_without_what_the_engine_calls_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """A torch whose pipelining._backward lacks a split-backward helper (torch 2.4 has none; a later torch may move
    them) or has it taking other arguments (torch 2.5): the runtime still imports, a zb-v run stops in one line
    naming the helper and the fix, before any rank starts; other schedules need no helper. A schedule class whose
    step() takes no return_outputs (an older torch) is refused for every schedule."""
    import importlib
    import sys

    import runtime
    import runtime.torch_engine
    from torch.distributed import pipelining
    from torch.distributed.pipelining import _backward

    profile = profile_of("tests.capture_models:saved_and_sent", sizes=(2,))
    zbv, gpipe = plan_with(profile, [1, 3, 4], 2, 4, "zb-v"), plan_with(profile, [2], 2, 4, "gpipe")

    # the helper missing (torch 2.4), and torch 2.5's, which takes no reverse graph
    for simulate in (lambda patch: patch.delattr(_backward, "get_param_groups"),
                     lambda patch: patch.setattr(_backward, "get_param_groups", lambda inputs, params: [])):
        with monkeypatch.context() as patch:  # (undone after each: the module as imported here comes back)
            patch.delitem(sys.modules, "runtime.torch_engine")  # imported again, as on that torch
            patch.setattr(runtime, "torch_engine", runtime.torch_engine)
            simulate(patch)
            engine = importlib.import_module("runtime.torch_engine")
            assert _refused(tmp_path, zbv) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and "Traceback" not in err, err
            assert "needs torch >= 2.6 with torch.distributed.pipelining._backward.get_param_groups" in err, err
            assert "use --engine own (the default) or upgrade torch" in err, err
            assert engine.refusal(gpipe) is None
    assert not [n for n in os.listdir(str(tmp_path)) if n != "plan.json"]

    class OlderGPipe(pipelining.ScheduleGPipe):
        def step(self, *args, target=None, losses=None, **kwargs):  # torch's before return_outputs
            return None

    monkeypatch.setattr(pipelining, "ScheduleGPipe", OlderGPipe)
    assert "needs a newer torch, with ScheduleGPipe.step(return_outputs=)" in runtime.torch_engine.refusal(gpipe)


def test_torch_engine_refuses_stages_torch_would_place_elsewhere():
    from runtime.torch_engine import refusal

    plan = reshape_plan(plan_with(profile_of("builtin:gpt"), [1, 3, 6], 2, 8, "gpipe"), virtual_stages=2,
                        schedule="bfs")
    assert refusal(plan) is None
    moved = dataclasses.replace(plan, stages=[dataclasses.replace(s, device=[0, 0, 1, 1][g])
                                              for g, s in enumerate(plan.stages)])
    assert "g mod p" in refusal(moved)


def test_a_torchrun_rank_refuses_before_joining_the_group(tmp_path, monkeypatch):
    from runtime.worker import main as worker_main

    plan = reshape_plan(plan_with(profile_of("tests.models:tied_lm"), [2], 2, 8, "1f1b"), replicas=[1, 2])
    path = os.path.join(str(tmp_path), "plan.json")
    with open(path, "w") as f:
        json.dump(plan.to_json(), f)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert worker_main([path, "--engine", "torch", "--out-dir", str(tmp_path)]) == 1
    with open(os.path.join(str(tmp_path), "rank0.error")) as f:
        error = f.read().strip()
    assert len(error.splitlines()) == 1 and "replicated stages" in error
