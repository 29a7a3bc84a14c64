"""Tool calling on chat completions (L5): the request's tools and tool_choice → a ToolPlan, which
renders the tools for the chat template, constrains the output when a call is required, and
turns the model's text back into OpenAI `tool_calls`.

    tool_choice "none"       tools shown (when the template can), plain text back
    tool_choice "auto"       the model decides; its text parsed by --tool-call-parser
                             (needs --enable-auto-tool-choice, as vLLM)
    tool_choice "required"   structured output: a JSON array of {"name", "arguments"}, ≥ 1 call
    {"type": "function", "function": {"name": N}}
                             structured output: the arguments object of N

Legacy `functions` / `function_call` map onto tools / tool_choice. A chat template that cannot
render tools (its source never mentions them, like SmolLM2's) gets them in a system message
instead, in Hermes' format, which the hermes parser reads back.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenbus.api.openai.protocol import ChatCompletionRequest
from tokenbus.api.openai.tool_parsers import ParsedCall, ToolCallParser
from tokenbus.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
TOOLS_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are listed "
    "within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a JSON "
    "object with the function name and arguments within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI tool objects, validated
    mode: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True
    parser: ToolCallParser | None = None  # for "auto"
    call_ids: list[str] = field(default_factory=list)
    # `functions` / `function_call` (OpenAI's legacy form): one call, answered as the message's
    # `function_call` with finish reason "function_call".
    legacy: bool = False

    @property
    def parameters(self) -> dict[str, dict]:
        return {
            t["function"]["name"]: t["function"].get("parameters") or EMPTY_PARAMETERS
            for t in self.tools
        }

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint that makes a required or named call parse and validate."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.parameters[self.named])
        if self.mode != "required":
            return None
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [name]}, "arguments": schema},
                    "required": ["name", "arguments"],
                }
                for name, schema in self.parameters.items()
            ]
        }
        schema = {"type": "array", "items": item, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def calls_from_text(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished choice."""
        if self.mode == "named":  # the text as generated: what the stream's fragments add up to
            return None, [ParsedCall(self.named, text)]
        if self.mode == "required":
            try:
                values = json.loads(text)
            except (ValueError, RecursionError):
                return text, []  # cut short (max_tokens): what there is, as text
            return None, [
                ParsedCall(v["name"], json.dumps(v["arguments"], ensure_ascii=False))
                for v in values
            ]
        if self.mode == "auto":
            parsed = self.parser.parse(text)
            return (parsed.content, parsed.calls) if parsed.calls else (text, [])
        return text, []


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def plan_tools(request: ChatCompletionRequest, parser: ToolCallParser | None) -> ToolPlan | None:
    """Validate tools and tool_choice (400s naming them); None when the request has no tools.
    `parser`: the server's --tool-call-parser when --enable-auto-tool-choice is on, else None."""
    tools, choice = request.tools, request.tool_choice
    if request.functions is None:
        if request.function_call is not None:
            raise ValueError("function_call: needs functions (with tools, use tool_choice)")
        return _plan(tools, choice, request.parallel_tool_calls, parser)
    if tools is not None:
        raise ValueError("functions: give either tools or functions, not both")
    tools = [{"type": "function", "function": f} for f in request.functions]
    fc = request.function_call
    if fc is not None:
        choice = fc if isinstance(fc, str) else {"type": "function", "function": fc}
    plan = _plan(tools, choice, False, parser)
    return None if plan is None else dataclasses.replace(plan, legacy=True)


def _plan(
    tools: list | None, choice: Any, parallel_tool_calls: bool | None, parser: ToolCallParser | None
) -> ToolPlan | None:
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice: needs tools")
        return None
    tools = [_check_tool(tool, i) for i, tool in enumerate(tools)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        function = choice.get("function")
        name = (
            function.get("name")
            if choice.get("type") == "function" and isinstance(function, dict)
            else None
        )
        if not isinstance(name, str):
            raise ValueError(
                'tool_choice: expected "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}'
            )
        if name not in names:
            raise ValueError(f"tool_choice: no tool is named {name!r}")
        return ToolPlan(tools, "named", named=name)
    if choice not in ("none", "auto", "required"):
        raise ValueError(
            f'tool_choice: expected "none", "auto", "required" or a named function, got {choice!r}'
        )
    if choice == "auto" and parser is None:
        raise ValueError(
            'tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
            '--tool-call-parser (or use "required" or a named function)'
        )
    parallel = parallel_tool_calls is not False
    return ToolPlan(tools, choice, parallel=parallel, parser=parser if choice == "auto" else None)


def _check_tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ValueError(
            f'{where}: only {{"type": "function", "function": {{...}}}} tools are supported'
        )
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function: needs a name")
    if not _NAME.match(function["name"]):
        raise ValueError(f"{where}.function.name: letters, digits, _ and - only, at most 64")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError(f"{where}.function.parameters: must be a JSON schema object")
    return {"type": "function", "function": function}


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def messages_for_template(
    messages: list[dict[str, Any]], plan: ToolPlan | None, native_tools: bool
) -> list[dict[str, Any]]:
    """The history as the template gets it. Templates that render tool calls expect their
    arguments as objects (they apply `tojson`); OpenAI sends them as JSON text. Without native
    tool support, calls become Hermes text and the tools a system message."""
    rendered = []
    for message in messages:
        message = copy.copy(message)
        calls = message.get("tool_calls")
        if calls:
            if native_tools:
                message["tool_calls"] = [_with_object_arguments(c) for c in calls]
            else:
                text = "\n".join(
                    f"<tool_call>\n{json.dumps(_call_json(c), ensure_ascii=False)}\n</tool_call>"
                    for c in calls
                )
                message["content"] = ((message.get("content") or "") + "\n" + text).strip()
                del message["tool_calls"]
        rendered.append(message)
    if plan is not None and plan.mode != "none" and not native_tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
        prompt = TOOLS_SYSTEM_PROMPT.format(tools=listing)
        if rendered and rendered[0].get("role") == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def _arguments_object(function: dict) -> Any:
    """A call's arguments as an object (OpenAI sends JSON text); text that is not JSON as is."""
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json goes
            pass
    return arguments


def _call_json(call: dict) -> dict:
    function = call.get("function") or {}
    return {"name": function.get("name"), "arguments": _arguments_object(function)}


def _with_object_arguments(call: dict) -> dict:
    call = copy.deepcopy(call)
    call["function"]["arguments"] = _arguments_object(call["function"])
    return call
