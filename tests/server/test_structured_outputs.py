"""Structured outputs through the official `openai` client against a live server (the default
model): JSON-schema outputs parse and validate (`jsonschema`), regex and choice outputs match,
streamed or not, by `response_format`, `structured_outputs` or the older `guided_*` fields;
a bad schema or regex, or two constraints at once, is a 400 naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "location": {
                "type": "object",
                "properties": {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                },
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "favourite": {"enum": ["red", "green", "blue"]},
        },
        "required": ["colors", "favourite"],
        "additionalProperties": False,
    },
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "student": {"type": "boolean"},
        },
        "required": ["name", "age", "student"],
        "additionalProperties": False,
    },
}
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(server, name):
    client = server.openai()
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_json_schema_output_validates(server):
    client = server.openai()
    schema = SCHEMAS["person"]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person."}],
        max_tokens=200,
        temperature=0.7,
        seed=5,
        stream=True,
        extra_body={"structured_outputs": {"json": schema}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice(server):
    client = server.openai()
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=150, temperature=0,
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": None},
    )  # fmt: skip
    if r.choices[0].finish_reason == "stop":  # a small model may write a long object
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    pattern = r"[A-Z][a-z]{2,8}, [A-Z]{2}"
    r = client.completions.create(
        model=MODEL, prompt="The city and its country code:", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": pattern}},
    )  # fmt: skip
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=10,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )
    assert r.choices[0].message.content in ("yes", "no", "maybe")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"structured_outputs": {"regex": "(oops"}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "object", "minProperties": "x"}}}, None),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, None),
    ],
)
def test_bad_constraints_are_400(server, extra, param):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
    if param is not None:
        assert e.value.body["param"] == param
