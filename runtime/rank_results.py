"""What a rank writes at the end of its run (runtime.worker): DIR/rank{R}.json, its state with
--save-state and its trace with --trace."""
from __future__ import annotations

import os
import resource
from typing import Any, Dict, List

import torch

from planner.jsonio import atomic_path, write_json_atomic
from planner.profile.subnormal import flushing
from runtime.rank_setup import RankProcess
from runtime.rank_transport import gradient_all_reduce, shared_reducer, shared_transport, tie_all_reduce
from runtime.stage import stage_state


def write_results(me: RankProcess, first_step: int, steps: List[Dict[str, Any]], link, host_kernel) -> None:
    """DIR/rank{R}.json (and the state with --save-state, the trace with --trace)."""
    args, topology, rank, m = me.args, me.topology, me.rank, me.plan.num_micro_batches
    pipeline_rank, stages = me.pipeline_rank, me.rank_model.stages
    peak = torch.cuda.max_memory_allocated(me.device) if me.device.type == "cuda" else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if me.sharding is not None:  # its shards and whole kept parameters, measured between steps
        static = me.sharding.resident_param_bytes()
    else:
        static = sum(p.numel() * p.element_size() for p in me.rank_model.parameters())  # each parameter once
    result = {"rank": rank, "pipeline_rank": pipeline_rank, "replica": topology.replica_of(rank),
              "lane": topology.lane_of(pipeline_rank), "chunks": [st.index for st in stages],
              "micro_batches": {str(st.index): len(topology.micro_batches_of(pipeline_rank, st.index, m))
                                for st in stages}, "threads": me.threads, "flush_subnormals": flushing(),
              "device": str(me.device),
              "optimizer": me.optimizer_name, "engine": args.engine, "first_step": first_step, "steps": steps, "peak_memory_bytes": peak, "peak_rss_bytes": rss,
              "start_rss_bytes": me.start_rss, "built_rss_bytes": me.built_rss,
              "peak_saved_bytes": me.engine.saved.peak, "param_bytes": static, "link": link,
              "host_kernel_s": host_kernel,
              # runtime/shared_memory.py: the ranks sharing this rank's /dev/shm (its messages to them went
              # through rings), and how many messages did
              "shared_memory_peers": sorted(shared_transport(me).peers) if shared_transport(me) else [],
              "shared_memory_messages": shared_transport(me).messages if shared_transport(me) else 0,
              # runtime/shared_reduce.py: how the gradient buckets were summed (None: the rank has none),
              # and how many through shared memory
              "gradient_all_reduce": gradient_all_reduce(me),
              "shared_memory_reductions": shared_reducer(me).reductions if shared_reducer(me) else 0,
              "tie_all_reduce": tie_all_reduce(me),  # the tied weights' sum, the same way (None: no tie)
              "p2p_note": me.p2p_note,
              "precision_note": me.rank_model.precision_note,
              "init_state_note": me.rank_model.init_state_note}
    # sharded parameters are gathered by every holder (a collective), saved by one
    gathered = me.sharding.full_states() if me.sharding is not None and args.save_state else [None] * len(stages)
    if args.save_state and topology.replica_of(rank) == 0 and topology.lane_of(pipeline_rank) == 0:
        state: Dict[str, torch.Tensor] = {}
        for stage, module_state in zip(stages, gathered):
            state.update(stage_state(stage, me.rank_model.spec, me.init_state, module_state))
        with atomic_path(os.path.join(args.out_dir, f"rank{rank}.pt")) as tmp:
            torch.save(state, tmp)
    if args.trace:
        write_json_atomic(os.path.join(args.out_dir, f"rank{rank}.trace.json"), me.events)
    write_json_atomic(os.path.join(args.out_dir, f"rank{rank}.json"), result)
