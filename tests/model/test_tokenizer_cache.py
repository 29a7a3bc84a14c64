"""The cache of tokenizers converted from GGUF files (loader/tokenizer.py): converted once, loaded
from the cache after, only the most recently used conversions kept."""

from __future__ import annotations

import json
from pathlib import Path


def test_gguf_tokenizer_is_converted_once_and_cached(tmp_path, monkeypatch):
    from tokenbus.loader import load_tokenizer
    from tokenbus.loader.source import resolve_model

    monkeypatch.setenv("TOKENBUS_CACHE_DIR", str(tmp_path / "cache"))
    src = resolve_model(None)
    first = load_tokenizer(src)  # converted from the GGUF, then saved
    (entry,) = (tmp_path / "cache" / "tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file()
    import tokenbus.loader.tokenizer as tokenizer_module

    def no_conversion(*args):
        raise AssertionError(
            "the cached entry must load through its generic class, not AutoTokenizer"
        )

    monkeypatch.setattr(tokenizer_module, "_from_pretrained", no_conversion)
    second = load_tokenizer(src)  # from the cache
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for tokenizer in (first, second):
        assert tokenizer.encode("Hello, world! 123") == first.encode("Hello, world! 123")
        assert tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        ) == first.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.eos_token_id == first.eos_token_id
    # the generic class loaded directly is what AutoTokenizer gave
    assert type(second) is type(first)
    assert list((tmp_path / "cache" / "tokenizers").iterdir()) == [entry]  # nothing left behind


def test_the_tokenizer_cache_keeps_the_most_recently_used_conversions(tmp_path, monkeypatch):
    """Each GGUF written anew (a new path or mtime) is a new entry: the cache keeps the most
    recently used ones, a hit counting as a use, and converts a pruned one again."""
    import tokenbus.loader.tokenizer as tokenizer_module

    conversions = []

    class Converted:
        def save_pretrained(self, directory):
            (Path(directory) / "tokenizer_config.json").write_text(json.dumps({}))

    def from_pretrained(directory, gguf_file):
        if gguf_file is not None:  # a conversion; else a cached entry loading
            conversions.append(gguf_file)
        return Converted()

    monkeypatch.setenv("TOKENBUS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_module, "_from_pretrained", from_pretrained)
    monkeypatch.setattr(tokenizer_module, "TOKENIZER_CACHE_ENTRIES", 2)
    files = {}
    for name in "abc":
        files[name] = tmp_path / f"{name}.gguf"
        files[name].write_bytes(b"")

    def load(name):
        tokenizer_module._from_gguf_cached(files[name])

    def cached():
        return sorted(entry.name[0] for entry in (tmp_path / "cache" / "tokenizers").iterdir())

    load("a"), load("b"), load("a")  # the second "a" is a hit, and the most recent use
    assert conversions == ["a.gguf", "b.gguf"] and cached() == ["a", "b"]
    load("c")  # "b" is the least recently used
    assert conversions[-1] == "c.gguf" and cached() == ["a", "c"]
    load("b")  # converted again
    assert conversions == ["a.gguf", "b.gguf", "c.gguf", "b.gguf"] and cached() == ["b", "c"]
