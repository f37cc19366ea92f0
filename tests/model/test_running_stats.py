"""Which modules keep running statistics (planner.model.running_stats): those whose training forward
updates buffers, whatever their class."""
from torch import nn

from planner.model.running_stats import keeps_running_statistics


def test_the_modules_that_update_statistics_are_the_ones_marked():
    for module, updates in ((nn.BatchNorm1d(4), True), (nn.BatchNorm2d(4, track_running_stats=False), False),
                            (nn.InstanceNorm2d(4, track_running_stats=True), True), (nn.InstanceNorm1d(4), False),
                            (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), False)):
        assert keeps_running_statistics(nn.Sequential(module)) == updates, module
