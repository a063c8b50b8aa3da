"""Tool calling and reasoning through the official `openai` client, on a live server running a
tiny random Llama with a byte-level tokenizer and a Qwen3-style chat template (tools in the
system turn, `<tool_call>` history, `enable_thinking`), started with
`--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`:
- a forced call (named function, and "required") has arguments that validate against the
  tool's schema, streamed and not, the stream's deltas adding up to the whole response;
- "auto" parses a hermes call out of the output, and the reasoning parser splits a think block
  off the answer, streamed and not (outputs forced with structured outputs: a random model
  writes neither by itself);
- tools and tool histories reach the template; `enable_thinking: false` reaches it too;
- the server speculates with n-gram drafts: a JSON-schema output over HTTP equals the offline
  engine's without speculation (greedy)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from impasto.testing import save_byte_tokenizer
from tests.entrypoints.conftest import build_checkpoint

from .conftest import start_server

pytestmark = pytest.mark.slow

TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C", "days": 2}}\n</tool_call>'  # noqa: E501
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
THINK = "<think>\nThe user wants the capital.\n</think>\n\nParis."


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    model = build_checkpoint(
        tmp / "model", "llama", vocab_size=272, eos_token_id=256, max_position_embeddings=2048
    )
    save_byte_tokenizer(model, chat_template=TEMPLATE)
    flags = [
        "--model", str(model), "--max-model-len", "2048", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        "--override-generation-config", '{"temperature": 0.0}', "--served-model-name", "tiny",
        "--dtype", "float32", "--speculative-config", json.dumps(NGRAM),
    ]  # fmt: skip
    server = start_server(tmp, extra=flags)
    server.model_path = model
    try:
        yield server
    finally:
        server.stop()


def _client(srv):
    return srv.openai()


def _create(srv, stream=False, **kw):
    return _client(srv).chat.completions.create(
        model="tiny", messages=kw.pop("messages", ASK), max_tokens=kw.pop("max_tokens", 200),
        stream=stream, **kw,
    )  # fmt: skip


def _streamed(chunks) -> tuple[dict, str | None]:
    """The deltas of a stream added up: content, reasoning, calls by index."""
    out: dict = {"content": "", "reasoning": "", "calls": {}}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            out["content"] += d.content or ""
            out["reasoning"] += (d.model_extra or {}).get("reasoning") or ""
            for tc in d.tool_calls or []:
                call = out["calls"].setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function.name:
                    call["name"] = tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return out, finish


def test_named_function_arguments_validate(srv):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = _create(srv, tools=TOOLS, tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    streamed, finish = _streamed(_create(srv, stream=True, tools=TOOLS, tool_choice=choice))
    assert streamed["calls"] == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert finish == r.choices[0].finish_reason == "stop"


def test_required_tool_calls_validate(srv):
    r = _create(srv, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    streamed, finish = _streamed(
        _create(srv, stream=True, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    )
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == [
        (call.function.name, json.loads(call.function.arguments))
    ]


def test_auto_parses_hermes_calls_and_reasoning_splits(srv):
    forced = {"structured_outputs": {"choice": [CALL]}}
    r = _create(srv, tools=TOOLS, extra_body=forced)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not msg.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C", "days": 2})
    ]
    streamed, finish = _streamed(_create(srv, stream=True, tools=TOOLS, extra_body=forced))
    assert finish == "tool_calls" and streamed["content"] == ""
    assert json.loads(streamed["calls"][0]["arguments"]) == {
        "city": "Paris",
        "unit": "C",
        "days": 2,
    }

    think = {"structured_outputs": {"choice": [THINK]}}
    r = _create(srv, extra_body=think)
    msg = r.choices[0].message
    assert msg.content == "Paris."
    assert msg.model_extra["reasoning"] == "\nThe user wants the capital.\n"
    streamed, _ = _streamed(_create(srv, stream=True, extra_body=think))
    assert streamed["content"] == "Paris."
    assert streamed["reasoning"] == "\nThe user wants the capital.\n"
    # enable_thinking=False reaches the template; an answer without a think block is content.
    plain = {"structured_outputs": {"choice": ["Paris."]}}
    r = _create(srv, extra_body={**plain, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "Paris."
    assert r.choices[0].message.model_extra.get("reasoning") is None


def test_tools_and_histories_reach_the_template(srv):
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather",
                      "arguments": '{"city": "Paris", "unit": "C", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    body = {"messages": history, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    ids = httpx.post(srv.url + "/tokenize", json=body, headers=srv.headers).json()["tokens"]
    text = bytes(t for t in ids if t < 256).decode()
    assert '"name": "get_time"' in text  # the tools
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<tool_response>sunny, 21 C</tool_response>" in text
    assert text.endswith("<think>\n\n</think>\n\n")
    r = _create(srv, messages=history, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls in (None, [])


def test_structured_output_with_ngram_speculation_equals_without(srv):
    """The server drafts with n-grams (the prompt repeats JSON the schema allows and forbids);
    the offline engine on the same checkpoint does not speculate: same greedy output."""
    from impasto import LLM, SamplingParams, StructuredOutputsParams

    messages = [{"role": "user", "content": '{"city":"Paris","unit":"C","days":3} ' * 3}]
    schema = {"type": "array", "items": WEATHER_SCHEMA, "maxItems": 3}
    r = _create(srv, messages=messages, extra_body={"structured_outputs": {"json": schema}})
    llm = LLM(str(srv.model_path), dtype="float32", max_model_len=2048, num_threads=2)
    so = StructuredOutputsParams(json=schema)
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs=so)
    (offline,) = llm.chat(messages, params, use_tqdm=False)
    assert r.choices[0].message.content == offline.outputs[0].text
    metrics = httpx.get(srv.url + "/metrics").text
    drafted = [
        line
        for line in metrics.splitlines()
        if line.startswith("impasto:spec_decode_num_draft_tokens")
    ]
    assert drafted and float(drafted[0].split()[-1]) > 0, drafted
