"""Bad requests get the right status and an OpenAI error body; never a 5xx, never a dead engine."""

from __future__ import annotations

import json

import httpx
import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG = "paint " * 600  # > max_model_len (512) tokens

# (endpoint, body, status, param): param None = any (or none).
BAD = [
    (C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    (C, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    (C, {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "hi", "presence_penalty": 9}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "logprobs": 100}, 400, "logprobs"),
    (C, {"prompt": "hi", "logprobs": -3}, 400, "logprobs"),
    (C, {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),  # the whole vocabulary > the cap
    (C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "hi", "stop": 5}, 400, "stop"),
    (C, {"prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    (C, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "seed": "x"}, 400, "seed"),
    (C, {"prompt": "hi", "allowed_token_ids": [10**9]}, 400, "allowed_token_ids"),
    (C, {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (C, {"prompt": "hi", "allowed_token_ids": "1,2"}, 400, "allowed_token_ids"),
    (CHAT, {"messages": MSG, "bad_words": [""]}, 400, "bad_words"),
    (CHAT, {"messages": MSG, "bad_words": "word"}, 400, "bad_words"),
    (C, {"prompt": "hi", "stream": "yes please"}, 400, "stream"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    (C, {"prompt": [-1]}, 400, "prompt"),
    (C, {"prompt": LONG}, 400, "input_tokens"),
    (C, {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
    (C, {"prompt": 12}, 400, "prompt"),
    (C, {}, 400, "prompt"),
    (C, {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    (C, {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "input_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "model"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
]


def _check_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_request(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)
    _check_error(r, status, param)


def test_context_length_wording(server):
    r = httpx.post(server.url + C, json={"prompt": LONG}, headers=server.headers)
    assert "This model's maximum context length is 512 tokens" in r.json()["error"]["message"]
    r = httpx.post(server.url + C, json={"prompt": "hi", "max_tokens": 600}, headers=server.headers)
    assert "'max_tokens' or 'max_completion_tokens' is too large: 600" in r.text


def test_malformed_json_and_size_limits(server):
    h = dict(server.headers, **{"Content-Type": "application/json"})
    r = httpx.post(server.url + C, content=b'{"prompt": "hi",', headers=h)
    _check_error(r, 400, None)
    r = httpx.post(server.url + C, content=b"\xff\xfe", headers=h)
    _check_error(r, 400, None)
    big = json.dumps({"prompt": "x" * (17 << 20)}).encode()
    r = httpx.post(server.url + C, content=big, headers=h, timeout=60)
    _check_error(r, 413, None)


def test_api_key(server):
    body = {"prompt": "hi", "max_tokens": 1}
    r = httpx.post(server.url + C, json=body)
    _check_error(r, 401, None)
    r = httpx.post(server.url + C, json=body, headers={"Authorization": "Bearer wrong"})
    _check_error(r, 401, None)
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer " + "x" * 500})
    _check_error(r, 401, None)
    assert httpx.get(server.url + "/health").status_code == 200  # open without a key
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_engine_alive_after_bad_requests(server):
    assert httpx.get(server.url + "/health").status_code == 200
    out = server.openai().completions.create(
        model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2, temperature=0
    )
    assert out.usage.completion_tokens >= 1
