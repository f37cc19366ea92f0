"""Built-in models (random weights from configs; no downloads): `builtin:NAME` is module NAME here,
whose `build(**model_args)` returns a ModelSpec; `hf:ClassName` is planner.model.builtin.hf."""

BUILTIN_MODELS = ("gpt", "resnet", "mlp", "mobilenet", "unet")
