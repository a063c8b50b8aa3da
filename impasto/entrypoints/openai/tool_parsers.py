"""Tool-call parsers (`--tool-call-parser NAME`): a model's own tool-call text -> OpenAI calls.

Each parser knows one model family's format and where its calls begin in the text:
- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, content before the first;
- `llama3_json` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}` (several
  joined by `;`), optionally after `<|python_tag|>`.
More are added with `@register_tool_parser("name")` on a `ToolParser` subclass (a plugin module
imported before the server starts is enough).

A call whose JSON does not parse is not a call: its text stays content, so nothing the model
wrote is lost. Arguments are always returned as JSON text, as OpenAI's API has them.

Streaming (`ToolCallStream`): content flows through until the text could be the start of a
call (a suffix that is a prefix of the parser's start marker is held back); from the marker
on, text is held and parsed when the output ends, then sent as tool-call deltas.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolParse:
    content: str | None  # what is not a call (None: nothing)
    calls: list[ToolCall]


class ToolParser(ABC):
    name: ClassVar[str]
    start: ClassVar[str]  # the text that begins a call (streaming holds text from it on)
    at_start_only: ClassVar[bool] = False  # calls only when the output begins with `start`

    @abstractmethod
    def parse(self, text: str) -> ToolParse: ...


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def add(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = name
        TOOL_PARSERS[name] = cls
        return cls

    return add


def get_tool_parser(name: str) -> ToolParser:
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return cls()


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ToolParse:
        head, found, _ = text.partition(self.start)
        if not found:
            return ToolParse(text, [])
        calls = []
        for m in self._CALL.finditer(text, len(head)):
            try:
                call = _call(json.loads(m.group(1).strip()), "arguments")
            except ValueError:
                call = None
            if call is None:
                return ToolParse(text, [])  # not a well-formed call: all of it is content
            calls.append(call)
        return ToolParse(head if head.strip() else None, calls)


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    start = "{"
    at_start_only = True
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> ToolParse:
        body = text.strip().removeprefix(self._TAG).strip()
        if not body.startswith("{"):
            return ToolParse(text, [])
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return ToolParse(text, [])
            call = _call(obj, "parameters")
            if call is None:
                return ToolParse(text, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\n;":
                pos += 1
        return ToolParse(None, calls)


class ToolCallStream:
    """Streams content until a call may begin, then holds the rest for `finish`."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._text = ""  # everything so far
        self._sent = 0  # characters of `_text` sent as content
        self._holding = False

    def feed(self, delta: str) -> str:
        """The content that can be sent now."""
        self._text += delta
        if self._holding:
            return ""
        start = self.parser.start
        if self.parser.at_start_only:
            stripped = self._text.lstrip()
            tag = Llama3JsonToolParser._TAG
            if stripped.startswith(start) or stripped.startswith(tag):
                self._holding = True
                return ""
            if len(stripped) < len(tag) and tag.startswith(stripped):
                return ""  # may still become the tag
            return self._release(len(self._text))
        at = self._text.find(start, self._sent)
        if at >= 0:
            self._holding = True
            return self._release(at)
        # hold back a suffix that may be the beginning of the marker
        keep = next(
            (n for n in range(min(len(start) - 1, len(self._text)), 0, -1)
             if start.startswith(self._text[-n:])),
            0,
        )  # fmt: skip
        return self._release(len(self._text) - keep)

    def _release(self, upto: int) -> str:
        out = self._text[self._sent : upto]
        self._sent = max(self._sent, upto)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not sent yet, the calls), once the output is complete."""
        parsed = self.parser.parse(self._text)
        if not parsed.calls:
            return self._release(len(self._text)), []
        content = parsed.content or ""
        rest = content[self._sent :] if len(content) > self._sent else ""
        self._sent = len(self._text)
        return rest, parsed.calls
