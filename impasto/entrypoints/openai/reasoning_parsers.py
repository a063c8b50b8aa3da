"""Reasoning parsers (`--reasoning-parser NAME`): the thinking text of a reasoning model goes to
the message's `reasoning` field (and `reasoning_content`, its older name), the answer to
`content`, streamed or not, as vLLM returns them.

- `qwen3`: thinking is `<think>...</think>` at the start of the output; an output without
  `</think>` is all content (what `chat_template_kwargs={"enable_thinking": false}` produces:
  the template closes an empty think block in the prompt);
- `deepseek_r1`: the template opens `<think>` in the prompt, so the output starts inside the
  thinking: everything before `</think>` is reasoning, and an output without it is all
  reasoning (it was cut before the answer).
More are added with `@register_reasoning_parser("name")`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

START, END = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str]
    unclosed_is_reasoning: ClassVar[bool]  # an output without END: reasoning, or content

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        body = text.removeprefix(START) if text.startswith(START) else text
        thinking, found, answer = body.partition(END)
        if not found:
            if self.unclosed_is_reasoning or text.startswith(START):
                return thinking or None, None
            return None, text or None
        return thinking or None, answer.lstrip("\n") or None


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(
    name: str,
) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def add(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        cls.name = name
        REASONING_PARSERS[name] = cls
        return cls

    return add


def get_reasoning_parser(name: str) -> ReasoningParser:
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        known = ", ".join(REASONING_PARSERS)
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}")
    return cls()


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    unclosed_is_reasoning = False


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    unclosed_is_reasoning = True


class ReasoningStream:
    """Splits a streamed output: `feed(delta) -> (reasoning delta, content delta)`. Text that
    may be the beginning of a tag is held back until the next delta shows what it is."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._text = ""
        self._sent = 0  # characters of `_text` accounted for
        # Where the stream is: before knowing (qwen3 waits to see whether a think block opens),
        # in the reasoning, or in the content.
        self._state = "reasoning" if parser.unclosed_is_reasoning else "start"

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        reasoning, content = "", ""
        while True:
            rest = self._text[self._sent :]
            if self._state == "start":
                stripped = rest.lstrip()
                if stripped.startswith(START):
                    self._sent += len(rest) - len(stripped) + len(START)
                    self._state = "reasoning"
                    continue
                if START.startswith(stripped):
                    return reasoning, content  # may still open a think block
                self._state = "content"
                continue
            if self._state == "reasoning":
                if rest.startswith(START):  # deepseek_r1 outputs may repeat the opening tag
                    self._sent += len(START)
                    continue
                at = rest.find(END)
                if at >= 0:
                    reasoning += rest[:at]
                    self._sent += at + len(END)
                    self._state = "after"
                    continue
                keep = _partial_suffix(rest, END)
                reasoning += rest[: len(rest) - keep]
                self._sent += len(rest) - keep
                return reasoning, content
            if self._state == "after":  # the newlines between the think block and the answer
                stripped = rest.lstrip("\n")
                self._sent += len(rest) - len(stripped)
                if not stripped:
                    return reasoning, content
                self._state = "content"
                continue
            content += rest
            self._sent += len(rest)
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back, once the output is complete."""
        rest = self._text[self._sent :]
        self._sent = len(self._text)
        if self._state in ("reasoning",):
            return rest, ""
        return "", rest


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
