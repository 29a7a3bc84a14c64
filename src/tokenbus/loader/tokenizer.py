"""Tokenizer (with chat template) and generation defaults of a model source."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenbus.loader.hf_loader import read_json
from tokenbus.loader.source import ModelSource


def load_tokenizer(src: ModelSource, tokenizer: str | None = None):
    """A transformers tokenizer: `tokenizer` (a directory or .gguf file) if given, else the model's.

    For GGUF, transformers builds it (vocabulary, merges, chat template) from the file's metadata.
    """
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not path.exists():
            raise ValueError(f"tokenizer: {tokenizer!r} not found (expected a directory or a .gguf file)")
        return _from_pretrained(path.parent if path.is_file() else path, path.name if path.is_file() else None)
    if src.kind == "gguf":
        return _from_pretrained(src.path.parent, src.path.name)
    return _from_pretrained(src.path, None)


def _from_pretrained(directory: Path, gguf_file: str | None):
    from transformers import AutoTokenizer  # lazy: importing transformers costs ~2 s

    where = directory / gguf_file if gguf_file else directory
    try:
        return AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"tokenizer: cannot load from {where}: {e}") from e


def load_generation_config(src: ModelSource) -> dict[str, Any]:
    """generation_config.json of an HF directory ({} when absent, and for GGUF)."""
    if src.kind != "hf":
        return {}
    path = src.path / "generation_config.json"
    return read_json(path) if path.is_file() else {}
