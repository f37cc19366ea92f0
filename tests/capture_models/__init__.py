"""Models for capture's edge cases, one module per kind: entry points `tests.capture_models:NAME`.

This package re-exports every entry point (and the classes tests import), so the specs that tests,
BENCHMARKS.md and docs name keep one spelling; `tests.capture_models.KIND:NAME` names the same function."""
from tests.capture_models.data_sized import ctc_labels, gated_rows, routed
from tests.capture_models.memory import (alias_cross, broadcast, class_token, conditioned, gated_layers, latents,
                                         saved_two_apart, shared_table, two_towers, unrolled)
from tests.capture_models.tracing import (Reversal, bad_loss, casts_like_hf, custom_functions, exports_otherwise,
                                          optional_arguments, per_sample, star_args, what_fx_drops)
from tests.capture_models.writes import (aliased_state, counter, ema_chain, forward_state, hidden_write,
                                         spectral_chain, writers)
from tests.capture_models.zb_split import cat_inputs, late_embedding, saved_and_sent, seq2seq

__all__ = ["Reversal", "alias_cross", "aliased_state", "bad_loss", "broadcast", "casts_like_hf", "cat_inputs",
           "class_token", "conditioned", "counter", "ctc_labels", "custom_functions", "ema_chain",
           "exports_otherwise", "forward_state", "gated_layers", "gated_rows", "hidden_write", "late_embedding",
           "latents", "optional_arguments", "per_sample", "routed", "saved_and_sent", "saved_two_apart", "seq2seq",
           "shared_table", "spectral_chain", "star_args", "two_towers", "unrolled", "what_fx_drops", "writers"]
