"""Image-and-text checkpoints whose text model is served (L2; no torch at import): which they
are, their text model's config (the `text_config`, or a flat file's fields, filled as
transformers fills them) and their text weights under the text model's own names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Image-and-text checkpoints whose text model is served: its `text_config`, and its weights
# under `language_model` (the vision tower and the projector are left unread). model_type ->
# the HF class that names it.
MULTIMODAL_MODEL_TYPES = {
    "gemma3": "Gemma3ForConditionalGeneration",  # Gemma 3 4B, 12B, 27B
    "gemma3n": "Gemma3nForConditionalGeneration",  # Gemma 3n E2B, E4B
    "gemma4": "Gemma4ForConditionalGeneration",  # Gemma 4 E2B, E4B, 26B-A4B, 31B
    "mistral3": "Mistral3ForConditionalGeneration",  # Mistral Small 3.1 / 3.2
    "qwen3_5": "Qwen3_5ForConditionalGeneration",  # Qwen3.5 0.8B-27B
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",  # Qwen3.5 35B-A3B, 122B-A10B, ...
    "qwen2_vl": "Qwen2VLForConditionalGeneration",  # Qwen2-VL 2B, 7B
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",  # Qwen2.5-VL 3B, 7B, 32B, 72B
    "qwen3_vl": "Qwen3VLForConditionalGeneration",  # Qwen3-VL 2B, 4B, 8B, 32B
}
# Image-and-text checkpoints whose released config.json is flat (the text model's fields at the
# top, beside vision_config): transformers builds their text_config from those fields.
_FLAT_MULTIMODAL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
# A multimodal checkpoint's text weights, by prefix: transformers' original layout and its
# newer one (model.language_model), and the LM head of each.
_TEXT_WEIGHT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
    # Qwen2-VL's and Qwen2.5-VL's released files: the text model's own names at the top,
    # beside visual.*
    *((f"model.{part}", f"model.{part}") for part in ("layers.", "embed_tokens.", "norm.")),
)


def is_multimodal(config: dict[str, Any]) -> bool:
    """An image-and-text checkpoint whose text model is served (MULTIMODAL_MODEL_TYPES)."""
    return config.get("model_type") in MULTIMODAL_MODEL_TYPES


def text_config(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The text model's config: config.json itself, or an image-and-text checkpoint's
    `text_config`, filled with its config class's defaults as transformers fills them (the
    released files leave most fields to those)."""
    if not is_multimodal(config):
        return config
    text = config.get("text_config")
    if text is None and config["model_type"] in _FLAT_MULTIMODAL_MODEL_TYPES:
        text = _flat_text_config(config, path)
    if not isinstance(text, dict) or not text.get("model_type"):
        name = MULTIMODAL_MODEL_TYPES[config["model_type"]]
        raise ValueError(
            f"{path}: model_type {config['model_type']!r}: {name} needs its text_config "
            "(with its model_type): its text model is served"
        )
    from transformers import AutoConfig  # lazy: only image-and-text checkpoints need it

    try:
        fields = {key: value for key, value in text.items() if key != "model_type"}
        filled = AutoConfig.for_model(text["model_type"], **fields).to_dict()
    except ValueError as exc:  # a text model_type transformers does not know
        raise ValueError(f"{path}: text_config: {exc}") from None
    # the checkpoint's own: its quantization, and whether its LM head is the embedding (the
    # outer model ties them, as transformers does, where the outer config says)
    for key in ("quantization_config", "tie_word_embeddings"):
        if key in config:
            filled[key] = config[key]
    return filled


def _flat_text_config(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The text_config transformers builds from a flat image-and-text config.json."""
    from transformers import AutoConfig  # lazy: only image-and-text checkpoints need it

    fields = {key: value for key, value in config.items() if key != "model_type"}
    try:
        return AutoConfig.for_model(config["model_type"], **fields).get_text_config().to_dict()
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {config['model_type']}: {exc}") from None


def text_model_weights(
    weights: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """An image-and-text checkpoint's text weights under the text model's own names; the vision
    tower's and the projector's are skipped."""
    for name, tensor in weights:
        for prefix, ours in _TEXT_WEIGHT_PREFIXES:
            if name.startswith(prefix):
                yield ours + name.removeprefix(prefix), tensor
                break
