"""Errors the commands report as one line, importable without torch (the CLI catches them before
any model is loaded)."""


class CaptureError(RuntimeError):
    """The model cannot be captured as a graph. The message names the cause and a way out."""
