import os
import sys

# Multi-process tests run several ranks on 2 cores: one thread each keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# Worker processes import test models (tests.models) too.
os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped where no CUDA device is available (never faked on the CPU)."""
    import pytest

    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
