"""L2 loaders: model sources, shapes, weights (safetensors, GGUF), tokenizers."""

from tokenbus.loader.model_loader import iter_weights, load_arch
from tokenbus.loader.source import DEFAULT_MODEL, ModelSource, resolve_model
from tokenbus.loader.tokenizer import load_generation_config, load_tokenizer, tokenizer_path

__all__ = [
    "DEFAULT_MODEL",
    "ModelSource",
    "resolve_model",
    "load_arch",
    "load_tokenizer",
    "load_generation_config",
    "iter_weights",
    "tokenizer_path",
]
