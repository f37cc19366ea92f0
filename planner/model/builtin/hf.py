"""Hugging Face transformers models by name: `hf:LlamaForCausalLM`, `hf:BertForMaskedLM`, ...

The model is built from its config class with random weights (nothing is downloaded):
every `--model-arg` except the batch arguments below overrides a config field
(`num_hidden_layers=4`, `hidden_size=256`, `tie_word_embeddings=True` ...). Caching and
every random draw of training (dropout, stochastic depth, layer drop, SpecAugment masks) are
switched off, so a pipeline trains exactly like one process. Attention is the
implementation Hugging Face picks by default: "sdpa" where the class supports it, else "eager";
`--model-arg attn_implementation=eager` chooses (profiles record it as `attention`). Batches are synthetic token ids; the loss is the family's usual one, from logits:

- causal LM (`...ForCausalLM`, `...LMHeadModel`): next-token cross-entropy (shifted);
- masked LM (`...ForMaskedLM`): cross-entropy on a deterministic ~1/7 of the positions,
  replaced by a mask token (the last id of the vocabulary);
- seq2seq (`...ForConditionalGeneration`, T5/BART): labels are the target tokens and the
  decoder reads them shifted right behind the decoder start token;
- image + text (`...ForConditionalGeneration` whose config has a `vision_config` and an image
  token, LLaVA): random images, and token ids that begin with one image token per image feature
  (the vision tower's patches) followed by `seq_len` text tokens; next-token cross-entropy on the
  text (the image token is the text vocabulary's last id);
- image classification (`...ForImageClassification`, ViT): random images and labels,
  cross-entropy.

Batch arguments: `seq_len` (default 16), `target_len` (seq2seq, default seq_len) and, for a vision
model whose config has no `image_size` (ResNet), `image_size` (default 224). A field of
a nested config is `SUBCONFIG__FIELD` (`text_config__num_hidden_layers=2`,
`vision_config__image_size=32`). LoRA fine-tuning: `lora_rank`, `lora_alpha`, `lora_targets`
(planner.model.lora) freeze the model's weights and add peft adapters.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict

import torch
import torch.nn.functional as F

from planner.model.lora import add_lora, split_lora_args
from planner.model.spec import ModelEntryError, ModelSpec

_CAUSAL = ("ForCausalLM", "LMHeadModel")
_MASKED = ("ForMaskedLM",)
_SEQ2SEQ = ("ForConditionalGeneration",)
_IMAGE_CLASSIFICATION = ("ForImageClassification",)
DEFAULT_IMAGE_SIZE = 224  # the images' side where the vision config has no image_size


def _family(name: str) -> str:
    for family, suffixes in (("causal", _CAUSAL), ("masked", _MASKED), ("seq2seq", _SEQ2SEQ),
                             ("image-classification", _IMAGE_CLASSIFICATION)):
        if name.endswith(suffixes):
            return family
    raise ModelEntryError(f"hf:{name}: no loss known for this head; use a ...ForCausalLM / ...LMHeadModel, "
                          "...ForMaskedLM, ...ForConditionalGeneration or ...ForImageClassification class, or write "
                          "a package.module:function entry returning planner.ModelSpec")


def _model_class(name: str):
    try:
        import transformers
    except ImportError:
        raise ModelEntryError("hf: models need transformers: pip install -e '.[hf]'") from None
    cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "config_class"):
        raise ModelEntryError(f"transformers has no model class {name!r} (e.g. hf:LlamaForCausalLM, "
                              "hf:GPT2LMHeadModel, hf:BertForMaskedLM, hf:T5ForConditionalGeneration)")
    return cls


def _sub_configs(config) -> list:
    """The config and the configs nested in it (LLaVA's vision_config and text_config)."""
    nested = [value for value in vars(config).values() if hasattr(value, "to_dict") and hasattr(value, "model_type")]
    return [config] + [c for sub in nested for c in _sub_configs(sub)]


def default_attention(cls) -> str:
    """Hugging Face's own default: sdpa where the class supports it, else eager."""
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


@functools.lru_cache(maxsize=None)
def _defaults(cls):
    """The class's default config, built once (read only: which fields it has)."""
    return cls.config_class()


def _has_field(config, key: str) -> bool:
    """Whether the constructor takes `key`: a field of the config, or of a dict field that holds it
    (transformers 5 keeps partial_rotary_factor and rope_theta in rope_parameters)."""
    return hasattr(config, key) or any(isinstance(value, dict) and key in value for value in vars(config).values())


def make_config(cls, overrides: Dict[str, Any], attention: str = ""):
    """The class's config with `overrides` (`SUB__FIELD` sets a nested config's field), no cache,
    no random draws in training (`_draws_at_random`), `attention` (default: `default_attention`; in
    nested configs too)."""
    top = {key: value for key, value in overrides.items() if "__" not in key}
    unknown = [key for key in top if not _has_field(_defaults(cls), key)]
    # top-level fields go to the constructor, which derives the fields that depend on them
    # (Llama's head_dim from hidden_size / num_attention_heads): set afterwards they would go stale
    config = cls.config_class(**({} if unknown else top))
    for key, value in overrides.items():
        target, _, field = key.rpartition("__")
        if not target:
            continue
        owner = getattr(config, target, None)
        if isinstance(owner, dict) and field in owner:  # a field of a dict (transformers 5's rope_parameters),
            setattr(config, target, {**owner, field: value})  # copied: a default dict may be shared
            continue
        if owner is None or not hasattr(owner, field):
            unknown.append(key)
            continue
        setattr(owner, field, value)
    if unknown:
        raise ModelEntryError(f"hf:{cls.__name__}: {cls.config_class.__name__} has no field(s) {', '.join(unknown)}; "
                              "batch arguments are seq_len and target_len, nested fields are SUBCONFIG__FIELD")
    for part in _sub_configs(config):
        part.use_cache = False
        for key, value in part.to_dict().items():
            if isinstance(value, float) and _draws_at_random(key):
                setattr(part, key, 0.0)
        part._attn_implementation = attention or default_attention(cls)
    return config


# float config fields of a random draw in training: dropout, stochastic depth (Swin's and ConvNeXt's
# drop_path_rate, EfficientNet's drop_connect_rate), dropped layers (layerdrop), SpecAugment's masks
# (wav2vec2's mask_time_prob): a rank draws from its own stream (runtime/streams.py), so the pipeline
# would not train as one process does
_RANDOM_FIELDS = ("dropout", "drop_path", "drop_connect", "layerdrop", "mask_time_prob", "mask_feature_prob")


def _draws_at_random(key: str) -> bool:
    return any(part in key for part in _RANDOM_FIELDS) or key.endswith("_pdrop")


def _arrange(cls, named: Dict[str, torch.Tensor]) -> tuple:
    """Inputs as positional tensors when they lead forward's signature (the runtime's simplest
    contract), else with a trailing keyword dict."""
    params = [p for p in inspect.signature(cls.forward).parameters if p != "self"]
    if params[:len(named)] == list(named):
        return tuple(named.values())
    return (dict(named),)


def _image_text(config) -> bool:
    return hasattr(config, "vision_config") and hasattr(config, "text_config") and hasattr(config, "image_token_id")


def hf_builder(name: str) -> Callable[..., ModelSpec]:
    cls = _model_class(name)
    family = _family(name)

    def build(seq_len: int = 16, target_len: int = 0, attn_implementation: str = "", **overrides: Any) -> ModelSpec:
        if attn_implementation not in ("", "eager", "sdpa"):
            raise ModelEntryError(f"hf:{name}: attn_implementation {attn_implementation!r} is not one this runtime "
                                  "runs on any device; use eager or sdpa")
        lora = split_lora_args(overrides)
        # a vision config without image_size (HF ResNet): the images' side is a batch argument
        side = int(overrides.pop("image_size")) if "image_size" in overrides and \
            not hasattr(_defaults(cls), "image_size") else DEFAULT_IMAGE_SIZE
        config = make_config(cls, overrides, attn_implementation)
        kind = "image-text" if family == "seq2seq" and _image_text(config) else family
        if kind == "image-text":  # the image token: the text vocabulary's last id, never drawn as text
            config.image_token_id = int(config.text_config.vocab_size) - 1
        model = cls(config)  # under `with torch.device("meta")` (analytic profiles) no memory is used
        model.train()
        text = config.text_config if kind == "image-text" else config
        vocab = int(getattr(text, "vocab_size", 0) or 0)
        tgt_len = target_len or seq_len
        vision = getattr(config, "vision_config", config)

        def tokens(g: torch.Generator, batch_size: int, length: int, high: int) -> torch.Tensor:
            return torch.randint(0, high, (batch_size, length), generator=g)

        def images(g: torch.Generator, batch_size: int) -> torch.Tensor:
            side_of = int(getattr(vision, "image_size", 0) or side)
            return torch.randn(batch_size, int(getattr(vision, "num_channels", 3)), side_of, side_of, generator=g)

        def batch(batch_size: int, step: int):
            g = torch.Generator().manual_seed(1_000_003 * step + 29)
            if kind == "image-classification":
                labels = torch.randint(0, int(config.num_labels), (batch_size,), generator=g)
                return _arrange(cls, {"pixel_values": images(g, batch_size)}), labels
            if kind == "image-text":
                patches = (int(vision.image_size) // int(vision.patch_size)) ** 2  # CLIP's CLS feature is dropped
                patches += getattr(config, "vision_feature_select_strategy", "default") == "full"  # ... or kept
                ids = tokens(g, batch_size, seq_len + 1, vocab - 1)
                image_ids = torch.full((batch_size, patches), config.image_token_id, dtype=ids.dtype)
                labels = torch.cat([torch.full_like(image_ids, -100), ids[:, 1:]], dim=1)
                pixels = images(g, batch_size)
                return _arrange(cls, {"input_ids": torch.cat([image_ids, ids[:, :-1]], dim=1),
                                      "pixel_values": pixels}), labels
            if kind == "causal":
                ids = tokens(g, batch_size, seq_len + 1, vocab)
                return _arrange(cls, {"input_ids": ids[:, :-1]}), ids[:, 1:]
            if kind == "masked":
                ids = tokens(g, batch_size, seq_len, vocab - 1)
                rows = torch.arange(batch_size).unsqueeze(1)
                masked = (torch.arange(seq_len).unsqueeze(0) + rows + step) % 7 == 0
                labels = torch.where(masked, ids, torch.full_like(ids, -100))
                return _arrange(cls, {"input_ids": torch.where(masked, vocab - 1, ids)}), labels
            source, labels = tokens(g, batch_size, seq_len, vocab), tokens(g, batch_size, tgt_len, vocab)
            start = getattr(config, "decoder_start_token_id", None) or getattr(config, "pad_token_id", None) or 0
            decoder_ids = torch.cat([torch.full_like(labels[:, :1], start), labels[:, :-1]], dim=1)
            if getattr(cls, "main_input_name", "") == "input_features":  # speech (Whisper): log-mel frames, the
                frames = 2 * int(config.max_source_positions)  # length its two convolutions expect
                features = torch.randn(batch_size, int(config.num_mel_bins), frames, generator=g)
                return _arrange(cls, {"input_features": features, "decoder_input_ids": decoder_ids}), labels
            named = {"input_ids": source, "attention_mask": torch.ones_like(source),
                     "decoder_input_ids": decoder_ids}
            return _arrange(cls, named), labels

        def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
            # a graph torch.fx captured returns the model's output as a plain dict (EfficientNet)
            logits = output["logits"] if isinstance(output, dict) and "logits" in output else \
                output.logits if hasattr(output, "logits") else output[0]
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                                   ignore_index=-100)

        return ModelSpec(module=add_lora(model, lora, f"hf:{name}"), batch=batch, loss=loss)

    build.__name__ = name
    return build
