"""One of the two processes `planner profile --link measure` starts (planner.profile.link.measure_link):
the pair's measurement (planner.profile.link.measure_pair) over the transport `runtime execute
--p2p` gives two CPU ranks of one host (messages and the gradient all-reduce), so that the
profile's latency and all-reduce rate are the ones a run pays; rank 0 prints it as JSON, with
"p2p" saying which transport it was. The rhythm (a two-stage step's lists with stand-in compute)
runs through this runtime's engine (runtime.message_rhythm): what a message costs a run between
computations, the engine's own work per message included."""
from __future__ import annotations

import datetime
import json
import sys
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from planner.profile.link import measure_pair
from runtime.comm import Operation, post
from runtime.message_rhythm import engine_rhythm_steps
from runtime.shared_memory import connect, ring_size
from runtime.shared_reduce import reducer


def poster(local):
    """planner.profile.link's `post` over this runtime's transport (runtime.comm.post with `local`)."""
    return lambda operations: post([Operation(*op) for op in operations], True, local)


def main(argv: Optional[Sequence[str]] = None) -> None:
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    rank, port = int(config["rank"]), int(config["port"])
    torch.set_num_threads(max(int(config["threads"]), 1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=float(config["timeout_s"])))
    local = summing = None
    try:
        if config.get("p2p", "auto") == "auto":  # room for a ring each way of the largest message
            local = connect(rank, 2, float(config["timeout_s"]), 2 * ring_size(max(config["sizes"])))
            summing = reducer(local, [0, 1], None, max(config["allreduce_sizes"]))
        measured = dict(measure_pair(rank, config, post=poster(local), reduce=summing and summing.all_reduce),
                        p2p="shared memory" if local else "gloo", allreduce_p2p="shared memory" if summing else "gloo")
        dist.barrier()
        if config.get("rhythm"):
            measured["rhythm"] = engine_rhythm_steps(rank, local, *config["rhythm"])
            dist.barrier()
        if rank == 0:
            print(json.dumps(measured), flush=True)
    finally:
        if summing is not None:
            summing.close()
        if local is not None:
            local.close()
        dist.destroy_process_group()
