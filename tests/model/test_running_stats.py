"""Which units write state in their forward (planner.model.running_stats): running statistics, whatever
the module's class, and any parameter or buffer the graph writes into, under any of its names."""
import torch
from torch import nn

from planner.model.capture import capture
from planner.model.running_stats import state_writers


class _Counting(nn.Module):
    """An EMA of its input and a step counter, kept in buffers and written in place (no norm layer)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
            self.steps += 1
        return self.lin(x) - self.mean


class _Net(nn.Module):
    def __init__(self, middle: nn.Module, width: int = 4):
        super().__init__()
        self.first, self.middle, self.last = nn.Linear(width, width), middle, nn.Linear(width, width)

    def forward(self, x):
        return self.last(self.middle(self.first(x)))


def _writers(middle: nn.Module, width: int = 4):
    captured = capture(_Net(middle, width), (torch.randn(2, width),))
    return {captured.units[k].name.split(".")[0] for k in state_writers(captured)}


def test_the_units_writing_state_are_the_ones_marked():
    for middle, writes in ((nn.BatchNorm1d(4), True), (nn.BatchNorm1d(4, track_running_stats=False), False),
                           (nn.InstanceNorm1d(4, track_running_stats=True), True), (nn.InstanceNorm1d(4), False),
                           (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), False), (_Counting(4), True),
                           (torch.nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)), True),
                           (torch.nn.utils.spectral_norm(nn.Linear(4, 4)), True), (nn.Linear(4, 4), False)):
        assert _writers(middle if not isinstance(middle, nn.InstanceNorm1d) else nn.Sequential(
            nn.Unflatten(1, (1, 4)), middle, nn.Flatten())) == ({"middle"} if writes else set()), middle


def test_a_buffer_written_in_an_autocast_region_is_written_state():
    class Seen(nn.Module):  # torch.export wraps the region in a higher-order operation (planner.model.inplace)
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("seen", torch.zeros(4))

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                self.seen.add_(x.detach().abs().mean(0))
            return self.lin(x)

    assert _writers(Seen()) == {"middle"}


def test_a_weight_clipped_through_data_is_written_state():
    class Clipped(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            self.lin.weight.data.clamp_(-0.5, 0.5)
            return self.lin(x)

    assert _writers(Clipped()) == {"middle"}
