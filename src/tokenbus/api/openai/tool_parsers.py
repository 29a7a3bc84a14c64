"""Tool calls in a model's text, for `tool_choice: "auto"` (L5), named as vLLM's
`--tool-call-parser` options:

    hermes       <tool_call>{"name": …, "arguments": {…}}</tool_call> (Hermes, Qwen 2/2.5/3)
    llama3_json  {"name": …, "parameters": {…}}, one per line or separated by ";" (Llama 3.x)
    mistral      [TOOL_CALLS][{"name": …, "arguments": {…}}, …] (Mistral)
    pythonic     [get_weather(city="Paris"), …] (Llama 4, ToolACE)

Each parser returns the text before the calls (None when empty) and the calls, arguments as
JSON text. Text that only looks like a call (bad JSON, no name) stays content: a model's prose
is never lost.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall]


def _call_from_json(value: object, arguments_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models quote their arguments
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _content(text: str) -> str | None:
    return text if text.strip() else None


class ToolCallParser:
    name: str
    # How a call begins; streamed text is held back while it could still be the start of one.
    marker: str
    calls_after_text = False  # whether calls may follow prose (else they open the output)
    needs_special_tokens = False  # the marker is a special token: detokenize with it kept

    def parse(self, text: str) -> ParsedOutput:
        """Never raises: whatever a model writes (sets in a pythonic call, JSON nested past the
        recursion limit) that does not parse as calls is content."""
        try:
            return self._parse(text)
        except Exception:  # noqa: BLE001 - the model's text decides, not our parser
            return ParsedOutput(text, [])

    def _parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def may_start_call(self, text: str) -> bool:
        """Whether `text` (the output so far) begins a tool call or could still become one."""
        stripped = text.lstrip()
        return stripped.startswith(self.marker) or self.marker.startswith(stripped)


class HermesParser(ToolCallParser):
    name, marker, calls_after_text = "hermes", "<tool_call>", True
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _parse(self, text: str) -> ParsedOutput:
        start = text.find(self.marker)
        if start < 0:
            return ParsedOutput(text, [])
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = _call_from_json(json.loads(body))
            except (ValueError, RecursionError):
                call = None
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        return ParsedOutput(_content(text[:start]), calls)


class Llama3JsonParser(ToolCallParser):
    name, marker = "llama3_json", "{"

    def _parse(self, text: str) -> ParsedOutput:
        stripped = text.strip().removeprefix("<|python_tag|>").strip()
        if not stripped.startswith("{"):
            return ParsedOutput(text, [])
        decoder, calls, index = json.JSONDecoder(), [], 0
        while index < len(stripped):
            try:
                value, end = decoder.raw_decode(stripped, index)
            except ValueError:
                return ParsedOutput(text, [])
            call = _call_from_json(value, "parameters")
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            index = end
            while index < len(stripped) and stripped[index] in " \t\r\n;":
                index += 1
        return ParsedOutput(None, calls)


class MistralParser(ToolCallParser):
    name, marker, calls_after_text, needs_special_tokens = "mistral", "[TOOL_CALLS]", True, True

    def _parse(self, text: str) -> ParsedOutput:
        start = text.find(self.marker)
        if start < 0:
            return ParsedOutput(text, [])
        try:
            value = json.loads(text[start + len(self.marker) :].strip())
        except (ValueError, RecursionError):
            return ParsedOutput(text, [])
        values = value if isinstance(value, list) else [value]
        calls = [_call_from_json(v) for v in values]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text, [])
        return ParsedOutput(_content(text[:start]), calls)


class PythonicParser(ToolCallParser):
    name, marker = "pythonic", "["

    def _parse(self, text: str) -> ParsedOutput:
        stripped = text.strip()
        if not (stripped.startswith("[") and stripped.endswith("]")):
            return ParsedOutput(text, [])
        try:
            tree = ast.parse(stripped, mode="eval")
        except SyntaxError:
            return ParsedOutput(text, [])
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return ParsedOutput(text, [])
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return ParsedOutput(text, [])
            try:  # literals only: nothing of the model's text is ever evaluated as code
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return ParsedOutput(text, [])
            calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return ParsedOutput(None, calls)


PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def make_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(
            f"tool_call_parser: unknown parser {name!r}; known: {', '.join(sorted(PARSERS))}"
        )
    return PARSERS[name]()
