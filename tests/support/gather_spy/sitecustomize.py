"""A spy on FSDP2's parameter gathers, for tests: on PYTHONPATH (this folder) of a rank started as its
own process (PIPEPLANNER_LAUNCH=subprocess), with PIPEPLANNER_GATHER_LOG set to a folder, each rank
appends one line per all-gather FSDP2 starts, `<rank> <unit's name in its stage> <FORWARD | PRE_BACKWARD>`,
to <folder>/<pid>.log (a unit already gathered is not gathered again: not logged). Behaviour is
unchanged: the real gather runs."""
import os

_FOLDER = os.environ.get("PIPEPLANNER_GATHER_LOG")
if _FOLDER:
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    _unshard = FSDPParamGroup.unshard

    def _logged_unshard(self, async_op: bool = False):
        gathered = self._all_gather_result is not None or self.is_unsharded
        _unshard(self, async_op)
        if not gathered:
            with open(os.path.join(_FOLDER, f"{os.getpid()}.log"), "a") as log:
                log.write(f"{dist.get_rank()} {self._module_fqn} {self._training_state.name}\n")

    FSDPParamGroup.unshard = _logged_unshard
