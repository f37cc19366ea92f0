"""Automatic pipeline-parallel planner for PyTorch."""
from planner.spec import ModelSpec

__all__ = ["ModelSpec"]
__version__ = "0.1.0"
