"""LLM-scale plans from analytic H100 profiles (issue 25): memory per stage by precision and sharding,
predicted step time and implied model-FLOP utilisation, against a measured run.

    python -m benchmarks.llm_scale [--only 1b|70b] [--time-limit S]

1b:  a public nanotron run of Llama-1B (24 layers, hidden 2048, FFN 4096, 32 heads, seq 4096, vocab
     32000 assumed) on 8 H100s: d = 2, p = 4, b = 4, 128 micro-batches, bf16 with fp32 gradient
     accumulation, AdamW, ZeRO-1, 1F1B, flash attention, no recomputation; measured 22.0 s per step
     and 38.1 GiB peak allocated on the busiest GPU. Costed here at the run's own (p, d, b), the split
     balanced by work, the same rules as every plan (no fitting to this run).
70b: Llama-70B shape (80 layers, hidden 8192, FFN 28672, 64 heads, 8 KV heads, seq 4096) solved on 64
     and 1,024 H100s (80 GiB, the default 2.5 GiB reserve), bf16-mixed AdamW, --shard auto, recomputation
     per unit, for pipeline depths p in --pipelines (the solver on each; deeper or shallower pipelines
     are left out for the time the exact simulation of their lists takes), next to a Megatron-style
     configuration without tensor parallelism (p = 16, d = 4, b = 1, ZeRO-1, every layer recomputed)
     costed by the same model.

Links: 400 GB/s between pipeline ranks and for data-parallel exchanges inside a node (NVLink), 50 GB/s
(one 400 Gb/s NIC per GPU) between nodes of 8 GPUs; the benchmark uses one figure per plan: NVLink when
the pipeline and replicas fit in a node, else the NIC's. MFU = 6 N T / (step x devices x 989 TFLOP/s),
N the parameters, T the tokens per step (attention FLOPs not counted, as usual).
"""
from __future__ import annotations

import argparse
import time

from planner.cost.model import evaluate, reserve_of
from planner.cost.options import CostOptions
from planner.profile.analytic import load_device_spec
from planner.profile.analytic_profile import analytic_profile
from planner.solve.api import solve
from planner.solve.baselines import balanced_split
from planner.solve.diagnose import InfeasibleError

GIB = 2 ** 30
PEAK = 989e12
NVLINK, NIC = 400e9, 50e9
LLAMA_1B = dict(num_hidden_layers=24, hidden_size=2048, intermediate_size=4096, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, seq_len=4096, tie_word_embeddings=False)
LLAMA_70B = dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=32000, seq_len=4096, tie_word_embeddings=False)


def _profile(args, sizes):
    started = time.perf_counter()
    profile = analytic_profile("hf:LlamaForCausalLM", args, sizes, load_device_spec("h100"), dtype="bfloat16")
    print(f"  analytic profile: {profile.num_units} units in {time.perf_counter() - started:.0f} s, "
          f"attention {profile.extra.get('attention')}")
    return profile


def _params(profile) -> float:
    return sum(u.param_bytes for u in profile.units) / 2  # bf16 profile


def _show(label, profile, cost, devices, tokens):
    mfu = 6 * _params(profile) * tokens / (cost.iteration_s * devices * PEAK)
    busiest = max(range(len(cost.device_memory)), key=lambda i: cost.device_memory[i])
    print(f"  {label}: p={cost.pipeline_ranks} d={cost.data_parallel} b={cost.micro_batch_size} "
          f"m={cost.num_micro_batches}  step {cost.iteration_s:.2f} s  MFU {mfu:.3f}  busiest device "
          f"{cost.device_memory[busiest] / GIB:.1f} GiB  feasible {cost.feasible}")
    for st in cost.stages:
        print(f"    stage {st.first_unit:>3}..{st.end_unit - 1:<3} params {st.param_bytes / GIB:6.2f}  grads "
              f"{st.grad_bytes / GIB:6.2f}  optimizer {st.optimizer_bytes / GIB:6.2f}  activations "
              f"{st.activation_bytes / GIB:6.2f}  device {cost.device_memory[st.device] / GIB:6.2f} GiB  "
              f"recomputed {len(st.recompute)}")
    return mfu


def _balanced(profile, b, stages):
    return balanced_split([u.forward_s[b] + u.backward_s[b] for u in profile.units], stages)


def llama_1b() -> None:
    print("Llama-1B, nanotron run on 8 H100s (measured 22.0 s, 38.1 GiB)")
    profile = _profile(LLAMA_1B, [4])
    opts = CostOptions(pipeline_ranks=4, global_batch=1024, data_parallel=2, optimizer="adamw",
                       precision="bf16-mixed", shard="optimizer", bandwidth=NVLINK, dp_bandwidth=NVLINK,
                       memory_cap=80 * GIB, recompute="none")
    cost = evaluate(profile, _balanced(profile, 4, 4), 4, opts)
    _show("predicted", profile, cost, 8, 1024 * 4096)
    tensors = max(cost.device_memory) - reserve_of(profile, opts)
    print(f"  step {cost.iteration_s / 22.0 - 1:+.1%} vs 22.0 s; tensors on the busiest device {tensors / GIB:.1f} "
          f"GiB (the reserve left out) vs 38.1 GiB allocated: {tensors / (38.1 * GIB) - 1:+.1%}")


def llama_70b(pipelines) -> None:
    print("Llama-70B shape, bf16-mixed AdamW, 80 GiB H100s, default reserve")
    profile = _profile(LLAMA_70B, [1])
    tokens = 1024 * 4096
    base = CostOptions(pipeline_ranks=1, global_batch=1024, optimizer="adamw", precision="bf16-mixed",
                       bandwidth=NIC, dp_bandwidth=NIC, memory_cap=80 * GIB)
    for devices in (64, 1024):
        best = None
        for p in pipelines:  # the solver on each depth (every shard, recomputation per unit)
            opts = base.with_(pipeline_ranks=p, data_parallel=devices // p, shard="auto", recompute="auto")
            started = time.perf_counter()
            try:
                found = solve(profile, opts, method="dp")
            except InfeasibleError:
                print(f"  {devices} devices, p={p}: nothing fits")
                continue
            print(f"  {devices} devices, p={p} d={devices // p}: {found.cost.iteration_s:.1f} s, shard "
                  f"{found.options.shard} (solved in {time.perf_counter() - started:.0f} s)")
            if best is None or found.cost.iteration_s < best.cost.iteration_s:
                best = found
        if best is not None:
            _show(f"best plan on {devices} devices, shard {best.options.shard}", profile, best.cost, devices, tokens)
    # Megatron-style without tensor parallelism: the distributed optimizer (ZeRO-1), every layer
    # recomputed (--recompute-granularity full), layers split evenly by work
    megatron = base.with_(pipeline_ranks=16, data_parallel=4, shard="optimizer", recompute="all")
    cost = evaluate(profile, _balanced(profile, 1, 16), 1, megatron, recompute=range(profile.num_units))
    _show("Megatron-style p=16 d=4 b=1, ZeRO-1, full recomputation", profile, cost, 64, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["1b", "70b"])
    parser.add_argument("--pipelines", default="8,16,32", help="pipeline depths p solved for the 70B model")
    args = parser.parse_args()
    if args.only in (None, "1b"):
        llama_1b()
    if args.only in (None, "70b"):
        llama_70b([int(p) for p in args.pipelines.split(",")])


if __name__ == "__main__":
    main()
