"""No silent no-op: every vLLM field impasto does not implement is a 400 naming it when it asks
for something, and accepted when it carries its no-op default (clients that send defaults keep
working). Also `truncate_prompt_tokens` (implemented), malformed tool histories, and
`stream_options` without `stream`."""

from __future__ import annotations

import httpx
import pytest

from impasto.entrypoints.openai import unsupported

CHAT_MSG = [{"role": "user", "content": "Hi"}]

# A value that asks for something, per field.
ASKING = {
    "guided_decoding_backend": "xgrammar",
    "structural_tag": "{}",
    "use_beam_search": True,
    "length_penalty": 0.5,
    "logits_processors": ["x"],
    "cache_salt": "abc",
    "kv_transfer_params": {"a": 1},
    "mm_processor_kwargs": {"a": 1},
    "functions": [{"name": "f"}],
    "function_call": {"name": "f"},
    "documents": [{"text": "x"}],
    "reasoning_effort": "low",
}
NOOP = {
    "response_format": {"type": "text"},
    "use_beam_search": False,
    "tools": [],
    "tool_choice": "none",
    "length_penalty": 1.0,
    "prompt_logprobs": None,
}


def test_every_listed_field_has_a_case():
    assert set(unsupported.CHAT) <= set(ASKING)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)


@pytest.mark.parametrize("name", sorted(unsupported.CHAT))
def test_unsupported_field_is_a_400_naming_it(server, name):
    body = {"messages": CHAT_MSG, "max_tokens": 1, name: ASKING[name]}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and err["message"] == f"'{name}' is not supported."
    if name in unsupported.SAMPLING:
        body = {"prompt": "Hi", "max_tokens": 1, name: ASKING[name]}
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    else:  # chat-only fields are not vLLM completions fields: ignored there like any extra
        assert name not in unsupported.SAMPLING


def test_malformed_tool_histories_are_refused(server):
    """Tool histories are implemented (tests/server/test_tools_and_reasoning.py); malformed
    ones are a 400 naming the message field."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
    ]
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls"
    messages = [{"role": "tool", "content": "sunny", "tool_call_id": 1}]
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].tool_call_id"


def test_no_op_defaults_are_accepted(server):
    body = {"messages": CHAT_MSG, "max_tokens": 1, **NOOP, "tool_calls": None}
    assert _post(server, "/v1/chat/completions", body).status_code == 200
    body = {"prompt": "Hi", "max_tokens": 1, "response_format": None, "use_beam_search": False}
    assert _post(server, "/v1/completions", body).status_code == 200


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    prompt = "one two three four five six seven eight nine ten"
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "truncate_prompt_tokens": 4}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4
    ids = _post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    tail = _post(server, "/v1/completions", {**body, "prompt": ids[-4:]}).json()
    del body["truncate_prompt_tokens"]
    assert r.json()["choices"][0]["text"] == tail["choices"][0]["text"]
    r = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    r = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    chat = {"messages": CHAT_MSG, "max_tokens": 1, "truncate_prompt_tokens": 3}
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3


def test_stream_options_need_stream(server):
    body = {"prompt": "Hi", "max_tokens": 1, "stream_options": {"include_usage": True}}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_priority_under_fcfs_is_refused(server):
    body = {"prompt": "Hi", "max_tokens": 1, "priority": 3}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert _post(server, "/v1/completions", {**body, "priority": 0}).status_code == 200


def test_truncation_lifts_the_length_precheck(server):
    """Text too long for the context is refused before tokenizing, unless the request truncates
    its prompt: then it is tokenized and its tail kept."""
    limit = _post(server, "/tokenize", {"prompt": "x"}).json()["max_model_len"]
    text = "paint " * (limit * 40)
    body = {"prompt": text, "max_tokens": 1}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_tokens", r.text
    r = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5, r.text
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    assert _post(server, "/v1/chat/completions", chat).status_code == 400
    r = _post(server, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 5})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5, r.text


def test_vllm_xargs_become_extra_args_which_an_ar_model_refuses(server):
    """vLLM's `vllm_xargs` reach `SamplingParams.extra_args`; only block-diffusion models read
    any, so an AR model answers 400 naming them rather than ignoring them."""
    body = {"prompt": "Hi", "max_tokens": 1, "vllm_xargs": {"threshold": 0.5}}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "extra_args", r.text
