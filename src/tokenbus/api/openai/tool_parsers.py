"""Tool calls in a model's text, for `tool_choice: "auto"` (L5), named as vLLM's
`--tool-call-parser` options:

    hermes       <tool_call>{"name": …, "arguments": {…}}</tool_call> (Hermes, Qwen 2/2.5/3)
    llama3_json  {"name": …, "parameters": {…}}, one per line or separated by ";" (Llama 3.x)
    mistral      [TOOL_CALLS][{"name": …, "arguments": {…}}, …] (Mistral)
    pythonic     [get_weather(city="Paris"), …] (Llama 4, ToolACE)
    glm45        <tool_call>get_weather
                 <arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>
                 (GLM-4.5, GLM-4.6, GLM-4.7: glm47 too, whose name runs on into the first key)
    minimax_m2   <minimax:tool_call><invoke name="get_weather">
                 <parameter name="city">Paris</parameter></invoke></minimax:tool_call> (MiniMax-M2)
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
                 ```json {…} ```<｜tool▁call▁end｜><｜tool▁calls▁end｜> (DeepSeek-V3, R1-0528;
                 deepseek_v31 too, and V3.1's form:
                 <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>)
    kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
                 <|tool_call_argument_begin|>{…}<|tool_call_end|><|tool_calls_section_end|>
    openai       gpt-oss's harmony messages addressed to a function:
                 <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{…}
                 (with --reasoning-parser openai_gptoss, as vLLM pairs them)

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
    markers: tuple[str, ...] = ()  # where a call may begin several ways: all of them
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

    def all_markers(self) -> tuple[str, ...]:
        return self.markers or (self.marker,)

    def may_start_call(self, text: str) -> bool:
        """Whether `text` (the output so far) begins a tool call or could still become one."""
        stripped = text.lstrip()
        return any(
            stripped.startswith(marker) or marker.startswith(stripped)
            for marker in self.all_markers()
        )

    def find_marker(self, text: str, start: int) -> int:
        """Where the first marker at or after `start` begins in `text`, or -1."""
        found = [i for marker in self.all_markers() if (i := text.find(marker, start)) >= 0]
        return min(found, default=-1)


class TaggedCallsParser(ToolCallParser):
    """Calls in tagged blocks after the content (Hermes's, GLM-4.5's, MiniMax-M2's): the text
    before the first block is content, and each block (`_BLOCK`'s group, closed or cut off by
    the end of the text) holds calls. A block that does not parse, or no call at all, leaves
    the whole output as content."""

    calls_after_text = True
    _BLOCK: re.Pattern[str]

    def _parse(self, text: str) -> ParsedOutput:
        start = text.find(self.marker)
        if start < 0:
            return ParsedOutput(text, [])
        calls: list[ParsedCall] = []
        for body in self._BLOCK.findall(text[start:]):
            found = self._block_calls(body)
            if found is None:
                return ParsedOutput(text, [])
            calls.extend(found)
        if not calls:
            return ParsedOutput(text, [])
        return ParsedOutput(_content(text[:start]), calls)

    def _block_calls(self, body: str) -> list[ParsedCall] | None:
        """The calls one block holds, or None where it does not parse."""
        raise NotImplementedError


class HermesParser(TaggedCallsParser):
    name, marker = "hermes", "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _block_calls(self, body: str) -> list[ParsedCall] | None:
        try:
            call = _call_from_json(json.loads(body))
        except (ValueError, RecursionError):
            return None
        return None if call is None else [call]


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


class HarmonyParser(ToolCallParser):
    """gpt-oss's harmony format: a message whose recipient is `functions.NAME` is a call, its
    body the arguments; the recipient may stand before the channel or after it. Other messages
    without a recipient (commentary preambles, the final answer) are content; analysis messages
    are reasoning, which --reasoning-parser openai_gptoss takes out first. `<|call|>`, which
    ends a call's turn, is a stop token and not text."""

    name, calls_after_text, needs_special_tokens = "openai", True, True
    marker = "<|channel|>commentary"
    markers = (marker, "to=functions.")
    # [<|start|>role][ to=recipient]<|channel|>channel[ to=recipient][ <|constrain|>]type<|message|>
    _HEADER = re.compile(
        r"(?:<\|start\|>\w*)?(?P<before>\s*to=[^\s<]+\s*)?<\|channel\|>(?P<channel>[^<]*)"
        r"(?:<\|constrain\|>[^<]*)?<\|message\|>"
    )
    _END = re.compile(r"<\|(?:end|call|return)\|>|(?=<\|start\|>)|(?=<\|channel\|>)")
    _RECIPIENT = re.compile(r"\bto=(\S+)")

    def _parse(self, text: str) -> ParsedOutput:
        content, calls, position = [], [], 0
        while (header := self._HEADER.search(text, position)) is not None:
            content.append(text[position : header.start()])
            end = self._END.search(text, header.end())
            body_end = end.start() if end is not None else len(text)
            body = text[header.end() : body_end]
            position = end.end() if end is not None else len(text)
            channel = header["channel"].split()[0] if header["channel"].split() else ""
            recipient = self._RECIPIENT.search(f"{header['before'] or ''} {header['channel']}")
            if recipient is None:
                if channel != "analysis":
                    content.append(body)
                continue
            if not recipient[1].startswith("functions."):
                continue  # a built-in tool's call (browser, python): not one of the request's
            try:
                call = _call_from_json(
                    {"name": recipient[1].removeprefix("functions."), "arguments": json.loads(body)}
                )
            except (ValueError, RecursionError):
                call = None
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        if not calls:
            return ParsedOutput(text, [])
        content.append(text[position:])
        return ParsedOutput(_content("".join(content)), calls)


class Glm45Parser(TaggedCallsParser):
    """GLM-4.5's calls (its chat template's format; GLM-4.6's and GLM-4.7's too):
    <tool_call>NAME, then <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> per argument, then
    </tool_call>; the name ends at a newline (GLM-4.5, 4.6) or at the first key (GLM-4.7). The
    template writes a string value bare and any other as JSON, so a value that parses as JSON is
    that JSON, and any other value its text."""

    name, marker = "glm45", "<tool_call>"
    needs_special_tokens = True  # the markers are added tokens of GLM's vocabulary
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def _block_calls(self, body: str) -> list[ParsedCall] | None:
        name = body.partition("<arg_key>")[0]
        arguments = body[len(name) :]
        name = name.strip()
        # a name is one word, and nothing but key/value pairs follows it
        if not name or len(name.split()) != 1 or self._ARG.sub("", arguments).strip():
            return None
        values = {key.strip(): _json_or_text(v) for key, v in self._ARG.findall(arguments)}
        return [ParsedCall(name, json.dumps(values, ensure_ascii=False))]


class Glm47Parser(Glm45Parser):
    name = "glm47"  # vLLM's name for GLM-4.7's (the same parser here)


class MiniMaxM2Parser(TaggedCallsParser):
    """MiniMax-M2's calls: one <minimax:tool_call> block of <invoke name="NAME"> elements, each
    a <parameter name="KEY">VALUE</parameter> per argument. A value's text loses one newline at
    either end (the template's layout); then, as GLM-4.5's, it is JSON where it parses as JSON,
    its text otherwise. Anything but invokes in the block, or but parameters in an invoke,
    leaves the output as content."""

    name, marker = "minimax_m2", "<minimax:tool_call>"
    needs_special_tokens = True  # the block's tags are added tokens of its vocabulary
    _BLOCK = re.compile(r"<minimax:tool_call>(.*?)(?:</minimax:tool_call>|$)", re.DOTALL)
    _INVOKE = re.compile(r'<invoke name="([^"<>]+)">(.*?)(?:</invoke>|$)', re.DOTALL)
    _PARAMETER = re.compile(r'<parameter name="([^"<>]+)">(.*?)</parameter>', re.DOTALL)

    def _block_calls(self, body: str) -> list[ParsedCall] | None:
        if self._INVOKE.sub("", body).strip():
            return None
        calls = []
        for name, invoke in self._INVOKE.findall(body):
            if self._PARAMETER.sub("", invoke).strip():
                return None
            values = {
                key: _json_or_text(value.removeprefix("\n").removesuffix("\n"))
                for key, value in self._PARAMETER.findall(invoke)
            }
            calls.append(ParsedCall(name, json.dumps(values, ensure_ascii=False)))
        return calls


class DeepSeekV3Parser(TaggedCallsParser):
    """DeepSeek-V3's calls (R1-0528's too): in a <｜tool▁calls▁begin｜> section, each call
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME, a fenced JSON block of its arguments, then
    <｜tool▁call▁end｜>; V3.1's write NAME<｜tool▁sep｜>ARGUMENTS, the JSON bare. Either form is
    read. Anything else in the section leaves the output as content."""

    name, marker = "deepseek_v3", "<｜tool▁calls▁begin｜>"
    needs_special_tokens = True  # the markers are added tokens of DeepSeek's vocabulary
    _BLOCK = re.compile(r"<｜tool▁calls▁begin｜>(.*?)(?:<｜tool▁calls▁end｜>|$)", re.DOTALL)
    _CALL = re.compile(
        r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.DOTALL
    )
    _FENCED = re.compile(r"([^\s`]+)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)

    def _block_calls(self, body: str) -> list[ParsedCall] | None:
        if self._CALL.sub("", body).strip():
            return None
        calls = []
        for head, rest in self._CALL.findall(body):
            fenced = self._FENCED.fullmatch(rest) if head.strip() == "function" else None
            name, arguments = fenced.groups() if fenced else (head.strip(), rest)
            call = _call_from_json({"name": name, "arguments": arguments.strip()})
            if call is None or len(name.split()) != 1:
                return None
            calls.append(call)
        return calls


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"  # vLLM's name for V3.1's form (the same parser here)


class KimiK2Parser(TaggedCallsParser):
    """Kimi K2's calls: in a <|tool_calls_section_begin|> section, each call
    <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS (JSON)
    <|tool_call_end|>. Anything else in the section leaves the output as content."""

    name, marker = "kimi_k2", "<|tool_calls_section_begin|>"
    needs_special_tokens = True
    _BLOCK = re.compile(
        r"<\|tool_calls_section_begin\|>(.*?)(?:<\|tool_calls_section_end\|>|$)", re.DOTALL
    )
    _CALL = re.compile(
        r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+):\d+\s*"
        r"<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|$)",
        re.DOTALL,
    )

    def _block_calls(self, body: str) -> list[ParsedCall] | None:
        if self._CALL.sub("", body).strip():
            return None
        calls = []
        for name, arguments in self._CALL.findall(body):
            call = _call_from_json({"name": name, "arguments": arguments.strip()})
            if call is None:
                return None
            calls.append(call)
        return calls


def _json_or_text(text: str) -> object:
    """A call's argument written as its template writes them: JSON unless it is a string."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls
    for cls in (
        *(HermesParser, Llama3JsonParser, MistralParser, PythonicParser, HarmonyParser),
        *(Glm45Parser, Glm47Parser, MiniMaxM2Parser),
        *(DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser),
    )
}


def make_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(
            f"tool_call_parser: unknown parser {name!r}; known: {', '.join(sorted(PARSERS))}"
        )
    return PARSERS[name]()
