"""Tokenizer (with chat template) and generation defaults of a model source."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenbus.loader.hf_loader import read_json
from tokenbus.loader.source import ModelSource
from tokenbus.utils import cache_dir


def tokenizer_path(tokenizer: str) -> Path:
    """An explicit --tokenizer as a path; ValueError naming the field when it does not exist
    (checked again at setup, before an engine starts: the tokenizer itself loads beside it)."""
    path = Path(tokenizer).expanduser()
    if not path.exists():
        raise ValueError(
            f"tokenizer: {tokenizer!r} not found (expected a directory or a .gguf file)"
        )
    return path


def load_tokenizer(src: ModelSource, tokenizer: str | None = None):
    """A transformers tokenizer: `tokenizer` (a directory or .gguf file) if given, else the model's.

    For GGUF, transformers builds it (vocabulary, merges, chat template) from the file's metadata
    (seconds for SmolLM2); the result is saved once under the cache dir and loaded from there.
    """
    if tokenizer is not None:
        path = tokenizer_path(tokenizer)
        return _from_pretrained(
            path.parent if path.is_file() else path, path.name if path.is_file() else None
        )
    if src.kind == "gguf":
        return _from_gguf_cached(src.path)
    return _from_pretrained(src.path, None)


def _from_gguf_cached(path: Path):
    """The GGUF's tokenizer, converted on first use and saved under cache_dir()/tokenizers,
    keyed by the file (path, size, mtime) and the transformers version."""
    import tokenizers
    import transformers

    stat = path.stat()
    key = hashlib.sha256(
        f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|"
        f"{tokenizers.__version__}".encode()
    ).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / f"{path.stem}-{key}"
    if cached.exists():
        try:
            tokenizer = _from_cache_entry(cached)
        except Exception:  # noqa: BLE001 - a damaged entry, whatever the error: convert again
            shutil.rmtree(cached, ignore_errors=True)
        else:
            _touch(cached)
            return tokenizer
    tokenizer = _from_pretrained(path.parent, path.name)
    tmp = None
    try:  # save to a private dir, then rename: a concurrent start never reads half a tokenizer
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)  # raises if another start got there first: theirs is as good
        _touch(cached)
    except OSError:  # that, or an unwritable cache (then the next start converts again)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    _keep_most_recent(cached.parent, TOKENIZER_CACHE_ENTRIES)
    return tokenizer


# Conversions the cache keeps, the most recently used. An entry is keyed by its file's path and
# mtime, so a GGUF written again and again (quantizing, test fixtures) leaves one behind each
# time (a few MB for a 49k vocabulary): without a bound the cache only grows.
TOKENIZER_CACHE_ENTRIES = 16


def _touch(entry: Path) -> None:
    """Mark an entry used now (its mtime orders _keep_most_recent), where the cache is writable.
    The time is the clock's, in ns: the kernel's own "now" for a file is rounded to its tick
    (4 ms at HZ=250), so two uses within one tick would tie and evict either."""
    try:
        now = time.time_ns()
        os.utime(entry, ns=(now, now))
    except OSError:
        pass


def _keep_most_recent(directory: Path, keep: int) -> None:
    """Remove all but the `keep` most recently used entries (a private dir another start is
    still saving into is among the newest)."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    entries.sort(key=_mtime_ns, reverse=True)
    for entry in entries[keep:]:
        shutil.rmtree(entry, ignore_errors=True)


def _mtime_ns(entry: Path) -> int:
    try:
        return entry.stat().st_mtime_ns
    except OSError:  # removed meanwhile by another start
        return 0


# The classes AutoTokenizer resolves a tokenizer_config.json naming them to, as themselves.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _from_cache_entry(directory: Path):
    """A conversion saved above. When its tokenizer_config.json names the generic fast class
    (SmolLM2's does), that class loads it directly: the class AutoTokenizer would pick, without
    AutoTokenizer's model-config machinery, which imports torch (a large share of a server's
    start-up, benchmarks/startup_profile.py, whose API process needs no torch). Any other class
    goes through AutoTokenizer."""
    import transformers

    name = read_json(directory / "tokenizer_config.json").get("tokenizer_class")
    if name in GENERIC_TOKENIZER_CLASSES and hasattr(transformers, name):
        return getattr(transformers, name).from_pretrained(str(directory), local_files_only=True)
    return _from_pretrained(directory, None)


# GGUF architectures whose config transformers cannot rebuild, which AutoTokenizer needs first.
# Their tokenizer comes from the file's tokenizer.ggml.* alone (TokenizersBackend, the class
# AutoTokenizer picks for a GGUF's BPE vocabulary as well: SmolLM3's is Llama 3's, Granite's a
# GPT-2 style BPE too, and OLMo 2's, OLMoE's and gpt-oss's, whose o200k pre-tokenizer
# transformers builds from `tokenizer.ggml.pre` "gpt-4o"; Gemma's (1) sentencepiece vocabulary
# goes through transformers' gemma tokenizer mapping, as Gemma 2's).
GGUF_TOKENIZER_WITHOUT_CONFIG = (
    *("smollm3", "granite", "granitemoe", "olmo2", "olmoe", "gpt-oss", "gemma"),
    *("ernie4_5", "ernie4_5-moe", "glm4", "mistral3", "cohere2", "exaone4", "granitehybrid"),
    *("nemotron_h", "lfm2moe", "qwen35", "qwen35moe", "qwen3next", "glm4moe", "command-r"),
    *("minimax-m2", "seed_oss", "arcee", "qwen2vl", "qwen3vl", "qwen3vlmoe", "deepseek2"),
    *("minicpm3", "gemma3n", "gemma4", "mistral4", "hunyuan-dense", "apertus", "dots1"),
)


def _from_pretrained(directory: Path, gguf_file: str | None):
    import transformers  # lazy: importing transformers takes seconds

    where = directory / gguf_file if gguf_file else directory
    loader = transformers.AutoTokenizer
    if gguf_file and _gguf_architecture(where) in GGUF_TOKENIZER_WITHOUT_CONFIG:
        loader = transformers.TokenizersBackend
    try:
        return loader.from_pretrained(str(directory), gguf_file=gguf_file, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"tokenizer: cannot load from {where}: {e}") from e


def _gguf_architecture(path: Path) -> str | None:
    from tokenbus.loader.gguf_file import read_gguf  # lazy: numpy and gguf

    try:
        return read_gguf(path).metadata.get("general.architecture")
    except ValueError:
        return None  # not a readable GGUF: AutoTokenizer says why


def load_generation_config(src: ModelSource) -> dict[str, Any]:
    """generation_config.json of an HF directory ({} when absent, and for GGUF)."""
    if src.kind != "hf":
        return {}
    path = src.path / "generation_config.json"
    return read_json(path) if path.is_file() else {}
