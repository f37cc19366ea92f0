"""Automatic pipeline-parallel planner for PyTorch.

`ModelSpec` is imported lazily: tools that only read plan files (the runtime's launcher) do not
pay for importing torch.
"""
__all__ = ["ModelSpec"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "ModelSpec":
        from planner.model.spec import ModelSpec

        return ModelSpec
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
