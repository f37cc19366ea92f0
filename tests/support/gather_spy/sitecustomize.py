"""A spy on FSDP2's collectives, for tests: on PYTHONPATH (this folder) of a rank started as its own
process (PIPEPLANNER_LAUNCH=subprocess), with PIPEPLANNER_GATHER_LOG set to a folder, each rank
appends one line per all-gather FSDP2 starts, `<rank> <unit's name in its stage> <FORWARD | PRE_BACKWARD>`
(a unit already gathered is not gathered again: not logged), and one per gradient reduce-scatter,
`<rank> <unit's name> REDUCE_SCATTER`, to <folder>/<pid>.log. Behaviour is unchanged: the real
collectives run."""
import os

_FOLDER = os.environ.get("PIPEPLANNER_GATHER_LOG")
if _FOLDER:
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    def _log(group, what: str) -> None:
        with open(os.path.join(_FOLDER, f"{os.getpid()}.log"), "a") as log:
            log.write(f"{dist.get_rank()} {group._module_fqn} {what}\n")

    _unshard = FSDPParamGroup.unshard

    def _logged_unshard(self, async_op: bool = False):
        gathered = self._all_gather_result is not None or self.is_unsharded
        _unshard(self, async_op)
        if not gathered:
            _log(self, self._training_state.name)

    _post_backward, _reduce, _reducing = FSDPParamGroup.post_backward, _fsdp_param_group.foreach_reduce, []

    def _logged_post_backward(self, *args):
        _reducing.append(self)  # the group whose gradients foreach_reduce is called for
        try:
            return _post_backward(self, *args)
        finally:
            _reducing.pop()

    def _logged_reduce(*args, **kwargs):
        _log(_reducing[-1], "REDUCE_SCATTER")
        return _reduce(*args, **kwargs)

    FSDPParamGroup.unshard = _logged_unshard
    FSDPParamGroup.post_backward = _logged_post_backward
    _fsdp_param_group.foreach_reduce = _logged_reduce
