"""Tool-call and reasoning parsers, and tool plans, without a model: whole outputs parse as
their formats say; streamed outputs, split anywhere (hypothesis), give the same content,
reasoning and calls as the whole output; bad tool requests are refused naming the field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from impasto.entrypoints.openai.chat_output import ChatReaders, ChoiceStream, render
from impasto.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from impasto.entrypoints.openai.tool_parsers import get_tool_parser
from impasto.entrypoints.openai.tools import plan_tools
from impasto.errors import InvalidParameterError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _calls(parse):
    return [(c.name, json.loads(c.arguments)) for c in parse.calls]


def test_hermes():
    p = get_tool_parser("hermes")
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    out = p.parse(text)
    assert out.content == "Let me check.\n"
    assert _calls(out) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    unclosed = p.parse('<tool_call>{"name": "get_time", "arguments": {}}')
    assert unclosed.content is None and _calls(unclosed) == [("get_time", {})]
    broken = p.parse("<tool_call>{not json}</tool_call>")
    assert broken.calls == [] and broken.content == "<tool_call>{not json}</tool_call>"
    assert p.parse("just text").content == "just text"


def test_llama3_json():
    p = get_tool_parser("llama3_json")
    out = p.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert _calls(out) == [("get_weather", {"city": "Oslo"})] and out.content is None
    two = p.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert _calls(two) == [("a", {}), ("b", {"x": 1})]
    assert p.parse("The weather is fine.").calls == []
    assert p.parse('{"not": "a call"}').calls == []


def test_reasoning_split():
    qwen3, r1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    assert qwen3.split("<think>\nhmm\n</think>\n\nParis.") == ("\nhmm\n", "Paris.")
    assert qwen3.split("Paris.") == (None, "Paris.")  # enable_thinking=False: no block
    assert r1.split("hmm</think>Paris.") == ("hmm", "Paris.")
    assert r1.split("still thinking") == ("still thinking", None)


OUTPUTS = [
    "<think>\nThe user asks.\n</think>\n\nParis is the capital.",
    'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<think>plan</think>\n\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "<thin is not a tag, nor is </thi",
    "<tool_call is not closed",
]


def _stream(readers: ChatReaders, text: str, cuts: list[int]) -> dict:
    stream = ChoiceStream(readers)
    parts, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        if cut > last:
            parts += stream.feed(text[last:cut])
            last = cut
    parts += stream.finish()
    out = {"content": "", "reasoning": "", "calls": []}
    for part in parts:
        out["content"] += part.get("content", "")
        out["reasoning"] += part.get("reasoning", "")
        out["calls"] += [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in part.get("tool_calls", [])
        ]
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streaming_equals_the_whole_output(data):
    text = data.draw(st.sampled_from(OUTPUTS))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    plan = plan_tools([WEATHER, TIME], "auto", None, True, False)
    readers = ChatReaders(plan, get_reasoning_parser("qwen3"), get_tool_parser("hermes"))
    whole = render(readers, text)
    streamed = _stream(readers, text, cuts)
    assert streamed["content"] == (whole.content or "")
    assert streamed["reasoning"] == (whole.reasoning or "")
    assert streamed["calls"] == [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]


def test_tool_plans():
    required = plan_tools([WEATHER, TIME], "required", False, False, False)
    schema = required.constraint["json"]
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = required.calls_of('[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}},
                       None, False, False)  # fmt: skip
    assert named.constraint == {
        "json": WEATHER["function"]["parameters"],
        "disable_any_whitespace": True,
    }
    assert plan_tools([WEATHER], "none", None, False, False).mode == "none"


@pytest.mark.parametrize(
    "tools, choice, auto, other",
    [
        ([WEATHER], "auto", False, False),  # auto needs --enable-auto-tool-choice
        ([WEATHER], None, False, False),  # tools without a choice mean auto
        (None, "required", True, False),  # a choice needs tools
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, True, False),
        ([WEATHER], "required", True, True),  # two constraints
        ([{"type": "retrieval"}], "none", True, False),
        ([WEATHER], "sometimes", True, False),
    ],
)
def test_bad_tool_requests(tools, choice, auto, other):
    with pytest.raises(InvalidParameterError) as e:
        plan_tools(tools, choice, None, auto, other)
    assert e.value.param in ("tools", "tool_choice")
