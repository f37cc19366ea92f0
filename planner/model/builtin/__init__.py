"""Built-in models (random weights from configs; no downloads)."""
