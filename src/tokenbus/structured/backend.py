"""xgrammar behind one small class: spec → compiled grammar → matcher (L2)."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from tokenbus.sampling_params import StructuredOutputsParams

_CPP_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] \S+\.cc:\d+: ")
# Compiled grammars kept per backend (xgrammar's own cache, keyed by the grammar text).
GRAMMAR_CACHE_BYTES = 64 << 20


def choice_ebnf(choices: list[str]) -> str:
    # JSON string escaping is valid EBNF string-literal escaping in xgrammar.
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def tokenizer_info(
    tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None
) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )


class XgrammarBackend:
    def __init__(self, info: xgr.TokenizerInfo, max_threads: int = 2, cache: bool = True) -> None:
        self.vocab_size = info.vocab_size
        self._compiler = xgr.GrammarCompiler(
            info,
            max_threads=max_threads,
            cache_enabled=cache,
            cache_limit_bytes=GRAMMAR_CACHE_BYTES,
        )

    @classmethod
    def from_tokenizer(
        cls, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None
    ) -> XgrammarBackend:
        return cls(tokenizer_info(tokenizer, vocab_size, stop_token_ids))

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile (or fetch from the cache); raises ValueError naming what is wrong."""
        try:
            return self._compile(spec)
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError) as exc:
            # xgrammar prefixes "[hh:mm:ss] /path/file.cc:123: "; users need only the reason.
            reason = _CPP_LOCATION.sub("", str(exc)).strip()
            raise ValueError(
                f"structured_outputs: {_kind(spec)} is invalid or unsupported: {reason}"
            ) from None

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile, then make sure the spec admits some output: a grammar whose first step
        allows no token at all (not even the end) could only end a request with an error."""
        matcher = self.new_matcher(self.compile(spec))
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise ValueError(f"structured_outputs: {_kind(spec)} admits no output at all")

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._compiler
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            json.loads(schema)  # a clear error for text that is not JSON at all
            # Compact JSON: free whitespace lets small models wander until max_tokens.
            return compiler.compile_json_schema(schema, any_whitespace=False)
        if spec.json_object:
            return compiler.compile_builtin_json_grammar()
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_grammar(choice_ebnf(spec.choice))
        return compiler.compile_grammar(spec.grammar)

    @staticmethod
    def new_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        # Rollback (for rejected draft tokens) is always unlimited in xgrammar >= 0.2.
        return xgr.GrammarMatcher(compiled)


def _kind(spec: StructuredOutputsParams) -> str:
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(spec, name) is not None:
            return {
                "json": "JSON schema",
                "regex": "regex",
                "choice": "choice",
                "grammar": "EBNF grammar",
            }[name]
    return "json_object"
