"""Tool calling on /v1/chat/completions: what a request's `tools`, `tool_choice` and
`parallel_tool_calls` mean, and its history's tool calls and results, as vLLM defines them.

- The tools reach the chat template (`tools=`), and so do assistant messages' `tool_calls`
  (arguments as objects, as templates expect) and `tool` messages' `tool_call_id`.
- `tool_choice`:
  - `"none"`: the model answers in text; its output is not parsed for calls;
  - `"auto"` (the default when tools are given): the output is parsed by the server's
    `--tool-call-parser`; it needs `--enable-auto-tool-choice` (a 400 otherwise, as in vLLM);
  - `"required"`: the output is constrained (structured outputs) to a JSON array of calls
    `[{"name": <one of the tools>, "parameters": <its schema>}, ...]`, at most one with
    `parallel_tool_calls: false`;
  - a named function: the output is constrained to that function's parameters schema, and is
    its arguments.
  With "required" and a named function the arguments are valid (compact) JSON for the schema
  by construction; these requests cannot carry another constraint (`response_format`, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from impasto.entrypoints.openai.tool_parsers import ToolCall
from impasto.errors import InvalidParameterError


@dataclass
class ToolPlan:
    """How the output of one chat request is read."""

    mode: str  # "none" | "auto" | "required" | "named" ("none" also when there are no tools)
    tools: list[dict[str, Any]] | None  # for the template, OpenAI's shape
    constraint: dict[str, Any] | None = None  # structured_outputs fields ("required", "named")
    function: str | None = None  # the named function
    parallel: bool = True

    def calls_of(self, text: str) -> list[ToolCall] | None:
        """The calls a constrained output holds ("required" / "named"); None if it does not
        parse (cut by max_tokens)."""
        if self.mode == "named":
            assert self.function is not None
            try:
                json.loads(text)
            except ValueError:
                return None
            return [ToolCall(self.function, text)]
        try:
            items = json.loads(text)
        except ValueError:
            return None
        calls = [
            ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
            for item in items
            if isinstance(item, dict) and isinstance(item.get("name"), str)
        ]
        return calls or None


# Calls are read by programs: compact JSON (no free whitespace for a model to loop in).
_COMPACT = {"disable_any_whitespace": True}


def _bad(param: str, message: str) -> InvalidParameterError:
    return InvalidParameterError(param, message)


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, checking OpenAI's tool shape."""
    if not isinstance(tools, list):
        raise _bad("tools", "tools must be a list of {type: function, function: {...}}.")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise _bad("tools", f"tools[{i}] must be of type 'function'.")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad("tools", f"tools[{i}].function needs a name.")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad("tools", f"tools[{i}].function.parameters must be a JSON schema object.")
        if fn["name"] in out:
            raise _bad("tools", f"tools: the function {fn['name']!r} is given twice.")
        out[fn["name"]] = params
    return out


def plan_tools(
    tools: Any,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    auto_enabled: bool,
    other_constraint: bool,
) -> ToolPlan:
    """The request's tool plan (InvalidParameterError naming the field on a bad request)."""
    parallel = parallel_tool_calls is not False
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "tool_choice needs tools.")
        return ToolPlan("none", None, parallel=parallel)
    functions = _functions(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tools, parallel=parallel)
    if choice == "auto":
        if not auto_enabled:
            raise _bad(
                "tool_choice",
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set (or send tool_choice 'none', 'required' or a named function).",
            )
        return ToolPlan("auto", tools, parallel=parallel)
    if other_constraint:
        raise _bad(
            "tool_choice",
            "tool_choice 'required' or a named function constrains the output: it cannot be "
            "combined with response_format or structured_outputs.",
        )
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            }
            for name, schema in functions.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            array["maxItems"] = 1
        return ToolPlan("required", tools, {"json": array, **_COMPACT}, parallel=parallel)
    name = None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
    if not isinstance(name, str):
        raise _bad(
            "tool_choice",
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}.',
        )
    if name not in functions:
        raise _bad("tool_choice", f"tool_choice names {name!r}, which is not among the tools.")
    constraint = {"json": functions[name], **_COMPACT}
    return ToolPlan("named", tools, constraint, function=name, parallel=parallel)


def history_message(index: int, message: Any, content: str) -> dict[str, Any]:
    """A chat message as the template sees it: tool calls with their arguments as objects,
    tool results with their call id."""
    out: dict[str, Any] = {"role": message.role, "content": content}
    extra = message.model_extra or {}
    if message.name is not None:
        out["name"] = message.name
    calls = extra.get("tool_calls")
    if calls:
        where = f"messages[{index}].tool_calls"
        if message.role != "assistant" or not isinstance(calls, list):
            raise _bad(where, f"{where}: only an assistant message holds a list of tool calls.")
        out["tool_calls"] = [_history_call(where, c) for c in calls]
    call_id = extra.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise _bad(f"messages[{index}].tool_call_id", "tool_call_id must be a string.")
        out["tool_call_id"] = call_id
    return out


def _history_call(where: str, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(where, f"{where}: each call needs function.name.")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise _bad(where, f"{where}: function.arguments is not valid JSON.") from None
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }
