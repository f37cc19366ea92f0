"""Making a plan: the plan of a solver's solution (`make_plan`), or of a chosen split (`plan_for_split`)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from planner.cost.model import evaluate, fixed_bytes, precision_of, reserve_of
from planner.cost.options import CostOptions
from planner.cost.ranges import range_costs
from planner.cost.result import PlanCost
from planner.pipeline.schedule import schedule_virtual_stages
from planner.plan.file import PER_INDEX_TERMS, Plan, PlanStage
from planner.profile.profile import Profile
from planner.solve.localsgd import averaging_s
from planner.solve.solution import OPTIMALITY_GAP, Solution


def durations_json(durations: Dict[Tuple, float], collectives) -> Dict[str, Any]:
    """The plan file's `step_durations` from the cost model's duration terms (planner.plan.file.Plan)."""
    out: Dict[str, Any] = {}
    for kind in PER_INDEX_TERMS:
        indices = sorted(term[1] for term in durations if term[0] == kind)
        out[kind] = [float(durations[(kind, i)]) for i in indices]
    out["message"] = float(durations.get(("message",), 0.0))
    out["collectives"] = [{"term": list(term), "ranks": list(ranks), "seconds": float(durations[term])}
                          for term, ranks in collectives]
    return out


def make_plan(profile: Profile, solution: Solution, opts: CostOptions, profile_path: str) -> Plan:
    """The plan for `solution` (as produced by planner.solve) of `profile`.

    `solution.options` (the scenario the solver chose: p, d, v, schedule) overrides `opts`.
    `stages` lists the p v stages in model order; stage c runs on pipeline rank `device` (c % p; zb-v: the V).
    Replicated stages (some r_g > 1) add `"replicas": r_g` to every stage, `device` = sum_{h<g} r_h
    (the first of its devices) and `pipeline_stages` = sum_g r_g; their `in_flight`, `memory_bytes`
    and `bubble_fraction` are per replica device.
    """
    opts = solution.options or opts
    b = solution.micro_batch_size
    cost = solution.cost
    last = len(cost.stages) - 1
    m, p = cost.num_micro_batches, cost.pipeline_ranks
    pipeline_s = cost.iteration_s - opts.step_overhead_s  # the simulated step
    rank_work = [sum(st.forward_s + st.backward_s for st in cost.stages if st.device == i) for i in range(p)]
    replicated = any(st.replicas > 1 for st in cost.stages)
    fixed = fixed_bytes(profile, opts)  # the reserve (+ gathered units under parameters sharding), per device
    stages: List[PlanStage] = []
    for index, st in enumerate(cost.stages):
        if replicated:  # per replica device: in_flight, memory_bytes; busy for ceil(m / r) micro-batches
            busy = -(-m // st.replicas) * (st.forward_s + st.backward_s)
        else:
            busy = m * rank_work[st.device]
        stages.append(PlanStage(
            index=index, device=st.device, units=[u.name for u in profile.units[st.first_unit:st.end_unit]],
            first_unit=st.first_unit, end_unit=st.end_unit, recompute=[profile.units[l].name for l in st.recompute],
            forward_s=st.forward_s, backward_s=st.backward_s, comm_s=st.comm_s, time_s=st.time_s,
            backward_input_s=st.backward_input_s, backward_weight_s=st.backward_weight_s,
            extra_s=st.extra_s, in_flight=st.in_flight,
            memory_bytes={"params": st.param_bytes, "grads": st.grad_bytes, "optimizer": st.optimizer_bytes,
                          "activations": st.activation_bytes, "total": st.memory_bytes, "fixed": fixed,
                          "device_total": cost.device_memory[st.device],
                          "saved_per_micro_batch": st.saved_per_micro_batch,
                          **({"weight_held_per_micro_batch": st.weight_held_per_micro_batch}
                             if st.weight_held_per_micro_batch is not None else {})},
            memory_cap_bytes=cost.device_caps[st.device],
            bubble_fraction=max(0.0, 1.0 - busy / pipeline_s) if pipeline_s > 0 else 0.0,
            recv=[v.at(b) for v in profile.cut(st.first_unit).values] if index > 0 else [],
            send=[v.at(b) for v in profile.cut(st.end_unit).values] if index < last else [],
            replicas=st.replicas if replicated else None))
    model = profile.model or {}
    return Plan(
        model={"entry": model.get("entry"), "args": model.get("args", {}), "seed": model.get("seed", 0)},
        profile={"path": profile_path, "torch_version": profile.torch_version, "device": profile.device,
                 "device_name": profile.device_name, "threads": profile.threads, "dtype": profile.dtype,
                 "host_kernel_s": profile.host_kernel.get("mean_s"),
                 **({"flush_subnormals": True} if profile.flush_subnormals else {})},
        schedule=cost.schedule, optimizer=opts.optimizer, precision=precision_of(opts, profile.dtype, profile.precision),
        shard=opts.shard, reserve_bytes=reserve_of(profile, opts), global_batch=opts.global_batch,
        data_parallel=cost.data_parallel, sync_every=opts.sync_every if opts.local_sgd else 1,
        averaging_s=averaging_s(solution) if opts.local_sgd else None,
        pipeline_stages=p, virtual_stages=cost.virtual_stages,
        micro_batch_size=b, num_micro_batches=m, memory_per_device_bytes=opts.memory_cap,
        bandwidth_bytes_per_s=opts.bandwidth, latency_s=opts.latency, step_overhead_s=opts.step_overhead_s,
        message_s=opts.message_s, step_durations=durations_json(cost.durations, cost.collectives),
        emulated_boundaries=emulated_boundaries(opts),
        placement=[list(row) for row in opts.placement.devices] if opts.placement is not None else None,
        emulated_exchange_s=emulated_exchange_s(opts, cost.durations, _sharded_rings(profile, cost, opts)),
        stages=stages, predicted_iteration_s=cost.iteration_s, bubble_fraction=cost.bubble_fraction,
        solver={"method": solution.method, "backend": solution.backend, "status": solution.status,
                "objective": solution.objective, "bound": solution.bound, "gap": solution.gap,
                "seconds": solution.seconds,
                # the search stopped within this gap (--gap); absent when it ran to its proof
                **({"requested_gap": solution.requested_gap} if solution.requested_gap > OPTIMALITY_GAP else {})})


def _sharded_rings(profile: Profile, cost: PlanCost, opts: CostOptions) -> Optional[List[float]]:
    """Per pipeline rank, ZeRO-3's collectives of a step (m per micro-batch of its units'
    planner.cost.ranges `sharded_collectives`); None for the other shard modes."""
    if opts.shard != "parameters":
        return None
    costs = range_costs(profile, cost.micro_batch_size, opts.optimizer)
    return [cost.num_micro_batches * sum(costs.sharded_collectives(st.first_unit, st.end_unit)
                                         for st in cost.stages if st.device == i) for i in range(cost.pipeline_ranks)]


def emulated_boundaries(opts: CostOptions) -> List[int]:
    """Stage boundaries j whose messages (between the ranks of stages j and j + 1) cross a link of the
    cluster that the runtime emulates (planner.cost.cluster; under a placement, in any replica:
    planner.cost.placement prices every replica's boundary at the slowest one's link)."""
    view = opts.device_view
    if view is None or opts.replicated:
        return []
    return [j for j in range(opts.num_stages - 1) if view.emulated(opts.rank_of_stage(j), opts.rank_of_stage(j + 1))]


def emulated_exchange_s(opts: CostOptions, durations: Dict[Tuple, float],
                        rings: Optional[Sequence[float]] = None) -> Optional[List[float]]:
    """Seconds of each pipeline rank's planned data-parallel exchange spent on emulated links (None:
    none), which the runtime holds after its own exchange; `rings`: per rank, the rings' latencies
    its exchange holds (default an all-reduce's two; ZeRO-3: one per collective of the step)."""
    if opts.placement is None:
        return None
    held = [opts.placement.emulated_exchange(i, durations.get(("reduce", i), 0.0), opts.latency,
                                             2.0 if rings is None else rings[i])
            for i in range(opts.pipeline_ranks)]
    return held if any(held) else None


def plan_for_split(profile: Profile, boundaries: List[int], micro_batch_size: int, global_batch: int,
                   schedule: str = "1f1b", profile_path: str = "",
                   replicas: Optional[Sequence[int]] = None) -> Plan:
    """A plan with the given cuts, not solved (status "fixed"): for running a chosen split, as
    tests and benchmarks do to compare splits on real runs. `replicas`: r_g per stage (default 1).
    A schedule with its own stages per device (zb-v: 2) puts that many on each device."""
    v = schedule_virtual_stages(schedule) or 1
    stages = len(boundaries) + 1
    if stages % v:
        raise ValueError(f"{schedule} runs {v} stages per device: {stages} stages do not divide")
    opts = CostOptions(pipeline_ranks=sum(replicas) if replicas else stages // v, global_batch=global_batch,
                       schedule=schedule, virtual_stages=v, replicas=tuple(replicas) if replicas else ())
    cost = evaluate(profile, boundaries, micro_batch_size, opts)
    solution = Solution(boundaries=list(boundaries), micro_batch_size=micro_batch_size,
                        num_micro_batches=global_batch // micro_batch_size, cost=cost, status="fixed",
                        objective=cost.iteration_s, bound=cost.iteration_s, gap=0.0, seconds=0.0,
                        method="fixed", backend="none")
    return make_plan(profile, solution, opts, profile_path)
