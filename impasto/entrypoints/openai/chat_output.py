"""What a chat choice's generated text becomes in the response: reasoning, content, tool calls.

Order (vLLM's): the reasoning parser takes the thinking out first; what remains is the
content, which the tool plan reads: parsed for calls (`auto`, by the server's tool-call
parser), taken as the calls themselves (`required`, `named`: the output was constrained to
them), or left as it is (`none`). A choice that made calls ends with finish_reason
`tool_calls` (except a named function, which OpenAI ends with `stop`).

`render` handles a whole output; `ChoiceStream` the same, delta by delta, for SSE: reasoning
and content stream as they come (a tag or a call marker split over deltas is held back until
it is whole), tool calls are sent once complete, a named function's arguments stream as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from impasto.entrypoints.openai.reasoning_parsers import ReasoningParser, ReasoningStream
from impasto.entrypoints.openai.tool_parsers import ToolCall, ToolCallStream, ToolParser
from impasto.entrypoints.openai.tools import ToolPlan


@dataclass
class ChatReaders:
    """The server's parsers and one request's tool plan."""

    plan: ToolPlan
    reasoning: ReasoningParser | None = None
    tool_parser: ToolParser | None = None


@dataclass
class Rendered:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = self.reasoning
        out["tool_calls"] = [c.as_openai() for c in self.tool_calls]
        return out


def finish_reason(readers: ChatReaders, calls: list[ToolCall], reason: str | None) -> str | None:
    if calls and reason == "stop" and readers.plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def render(readers: ChatReaders, text: str) -> Rendered:
    reasoning, content = None, text
    if readers.reasoning is not None:
        reasoning, content_or_none = readers.reasoning.split(text)
        content = content_or_none or ""
    plan = readers.plan
    if plan.mode == "auto" and readers.tool_parser is not None:
        parsed = readers.tool_parser.parse(content)
        calls = parsed.calls if plan.parallel else parsed.calls[:1]
        return Rendered(parsed.content if calls else content or None, reasoning, calls)
    if plan.mode in ("required", "named"):
        calls = plan.calls_of(content)
        if calls is not None:
            return Rendered(None, reasoning, calls)
    return Rendered(content if content or reasoning is None else None, reasoning)


class ChoiceStream:
    """One choice's stream: `feed(text) -> delta dicts`, `finish() -> the last ones`."""

    def __init__(self, readers: ChatReaders) -> None:
        self.readers = readers
        plan = readers.plan
        self.reasoning = ReasoningStream(readers.reasoning) if readers.reasoning else None
        self.tools = (
            ToolCallStream(readers.tool_parser)
            if plan.mode == "auto" and readers.tool_parser is not None
            else None
        )
        self._held = ""  # "required": the whole array, parsed at the end
        self._named_id = ToolCall(plan.function or "", "").id
        self._named_started = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._deltas(reasoning, content)

    def finish(self) -> list[dict[str, Any]]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        deltas = self._deltas(reasoning, content)
        plan = self.readers.plan
        if self.tools is not None:
            rest, calls = self.tools.finish()
            calls = calls if plan.parallel else calls[:1]
            if rest:
                deltas.append({"content": rest})
            self._add_calls(deltas, calls)
        elif plan.mode == "required":
            calls = plan.calls_of(self._held)
            if calls is None:  # cut short: what was generated is content
                deltas.append({"content": self._held})
            else:
                self._add_calls(deltas, calls)
        return deltas

    def _add_calls(self, deltas: list[dict[str, Any]], calls: list[ToolCall]) -> None:
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            deltas.append({"tool_calls": [{"index": index, **call.as_openai()}]})

    def _deltas(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reasoning:
            out.append({"reasoning": reasoning, "reasoning_content": reasoning})
        if not content:
            return out
        plan = self.readers.plan
        if self.tools is not None:
            content = self.tools.feed(content)
        elif plan.mode == "required":
            self._held += content
            return out
        elif plan.mode == "named":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": content}}
            if not self._named_started:
                self._named_started = True
                call.update(id=self._named_id, type="function")
                call["function"]["name"] = plan.function
                self.calls.append(ToolCall(plan.function or "", "", self._named_id))
            out.append({"tool_calls": [call]})
            return out
        if content:
            out.append({"content": content})
        return out
