"""Hand-written hostile requests against a live server: each gets a 4xx with OpenAI's error body
naming the parameter where there is one (never a 5xx, never a hang), and afterwards the server is
healthy and generates normally.

A few odd-but-valid inputs (control characters and NUL in a prompt, roles the chat template
renders) are answered 200: they are text, and the model takes them.
"""

# ruff: noqa: E501 - the cases are a table, one request a line

from __future__ import annotations

import json

import httpx
import pytest

from impasto import limits

C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
MSG = [{"role": "user", "content": "hi"}]
HUGE = b"1" * 400  # 10**400-ish as a JSON integer
TIMEOUT_S = 60.0


def _j(body: object) -> bytes:
    return json.dumps(body).encode()


def _raw(prefix: str, value: bytes, suffix: str = "}") -> bytes:
    return prefix.encode() + value + suffix.encode()


LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"


def case(id, path, body, param=None, status=400, ctype=""):
    """One hostile request: `param` None accepts any (or no) param in the error."""
    return pytest.param(path, body, ctype, status, param, id=id)


def hi(**fields) -> bytes:
    """A completion request for "hi" with `fields` added."""
    return _j({"prompt": "hi", **fields})


def chat(messages=MSG, **fields) -> bytes:
    return _j({"messages": messages, **fields})


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


HOSTILE = [
    # bytes and text that are not what they claim
    case("invalid-utf8", C, b'{"prompt": "\xff\xfe\xc3\x28"}'),
    case("lone-surrogate-prompt", C, b'{"prompt": "\\ud800"}', "prompt"),
    case("lone-low-surrogate-list", C, b'{"prompt": ["ok", "\\udfff"]}', "prompt"),
    case("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud83d"}]}', "messages"),
    case("lone-surrogate-stop", C, b'{"prompt": "hi", "stop": ["\\udc00"]}', "stop"),
    case("lone-surrogate-bad-words", C, b'{"prompt": "hi", "bad_words": ["\\udc00"]}', "bad_words"),
    case("lone-surrogate-extra", C, b'{"prompt": "hi", "allowed_token_ids": "\\ud800"}', "allowed_token_ids"),
    case("lone-surrogate-model", C, b'{"prompt": "hi", "model": "\\udc00"}', "model"),
    case("lone-surrogate-tokenize", TOK, b'{"prompt": "\\ud800x"}', "prompt"),
    # numbers JSON can spell but the engine cannot hold
    case("float-1e308", C, b'{"prompt": "hi", "temperature": 1e308}', "temperature"),
    case("float-overflow", C, b'{"prompt": "hi", "top_p": 1e999}', "top_p"),
    case("NaN", C, b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    case("Infinity", C, b'{"prompt": "hi", "presence_penalty": Infinity}', "presence_penalty"),
    case("-Infinity", C, b'{"prompt": "hi", "min_p": -Infinity}', "min_p"),
    case("NaN-logit-bias", C, b'{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
    case("huge-int-max-tokens", C, _raw('{"prompt": "hi", "max_tokens": ', HUGE), "max_tokens"),
    case("huge-int-n", C, _raw('{"prompt": "hi", "n": ', HUGE), "n"),
    case("huge-int-seed", C, _raw('{"prompt": "hi", "seed": ', HUGE), "seed"),
    case("huge-int-top-k", C, _raw('{"prompt": "hi", "top_k": ', HUGE), "top_k"),
    case("huge-int-min-tokens", C, _raw('{"prompt": "hi", "min_tokens": ', HUGE), "min_tokens"),
    case("huge-int-priority", C, _raw('{"prompt": "hi", "priority": ', HUGE), "priority"),
    case("huge-int-logprobs", C, _raw('{"prompt": "hi", "logprobs": ', HUGE), "logprobs"),
    case("huge-int-token", C, _raw('{"prompt": [', HUGE, "]}"), "prompt"),
    case("huge-int-stop-id", C, _raw('{"prompt": "hi", "stop_token_ids": [', HUGE, "]}"), "stop_token_ids"),
    case("huge-int-bias-key", C, _raw('{"prompt": "hi", "logit_bias": {"', HUGE, '": 1}}'), "logit_bias"),
    case("huge-int-detokenize", DETOK, _raw('{"tokens": [', HUGE, "]}"), "tokens"),
    case(
        "huge-int-top-logprobs",
        CHAT,
        _raw('{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": ', HUGE),
        "top_logprobs",
    ),
    case("int-too-long-to-parse", C, _raw('{"prompt": "hi", "seed": ', b"9" * 5000)),
    # token ids that are not token ids
    case("negative-token", C, _j({"prompt": [5, -1]}), "prompt"),
    case("float-token", C, _j({"prompt": [5, 1.5]}), "prompt"),
    case("integral-float-token", C, _j({"prompt": [5, 6.0]}), "prompt"),
    case("float-detokenize", DETOK, _j({"tokens": [5.0]}), "tokens"),
    case("string-token", C, _j({"prompt": [[5, "6"]]}), "prompt"),
    case("bool-prompt", C, _j({"prompt": True}), "prompt"),
    case("negative-token-batch", C, _j({"prompt": [[1, 2], [-7]]}), "prompt"),
    case("out-of-vocab-token", C, _j({"prompt": [2**40]}), "prompt"),
    case("negative-detokenize", DETOK, _j({"tokens": [-1]}), "tokens"),
    # empty things
    case("empty-prompt", C, _j({"prompt": ""}), "prompt"),
    case("empty-prompt-list", C, _j({"prompt": []}), "prompt"),
    case("empty-token-list-in-batch", C, _j({"prompt": [[]]}), "prompt"),
    case("empty-string-in-batch", C, _j({"prompt": ["hi", ""]}), "prompt"),
    case("empty-messages", CHAT, chat([]), "messages"),
    case("empty-object", C, b"{}", "prompt"),
    case("empty-tokenize", TOK, b"{}", "prompt"),
    case("empty-tokenize-messages", TOK, chat([]), "messages"),
    # messages of the wrong shape
    case("unknown-role", CHAT, chat([{"role": "wizard", "content": "hi"}]), "messages"),
    case("role-int", CHAT, chat([{"role": 5, "content": "hi"}]), "messages"),
    case("no-role", CHAT, chat([{"content": "hi"}]), "messages"),
    case("content-int", CHAT, chat(user(5)), "messages"),
    case("content-list-of-str", CHAT, chat(user(["hi"])), "messages"),
    case("content-part-image", CHAT, chat(user([{"type": "image_url", "image_url": {}}])), "messages"),
    case("content-part-text-int", CHAT, chat(user([{"type": "text", "text": 5}])), "messages"),
    case("messages-object", CHAT, chat({"role": "user", "content": "hi"}), "messages"),
    case("messages-string", CHAT, chat("hello"), "messages"),
    case("message-null", CHAT, chat([None]), "messages"),
    case("template-kwargs-clash", CHAT, chat(chat_template_kwargs={"add_generation_prompt": 1}), "chat_template_kwargs"),
    case("template-from-request", CHAT, chat(chat_template_kwargs={"chat_template": LOOPS}), "chat_template_kwargs"),
    case("template-kwargs-list", CHAT, chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    # caps
    case("10000-stop-strings", C, hi(stop=[f"s{i}" for i in range(10_000)]), "stop"),
    case("1MB-stop-string", C, hi(stop="x" * 10**6), "stop"),
    case("100k-stop-token-ids", C, hi(stop_token_ids=list(range(100_000))), "stop_token_ids"),
    case("20k-logit-bias", C, hi(logit_bias={str(i): 1 for i in range(20_000)}), "logit_bias"),
    case("logit-bias-out-of-range", C, hi(logit_bias={"5": -101}), "logit_bias"),
    case("logit-bias-non-ascii-digit", C, hi(logit_bias={"\u0663": 1}), "logit_bias"),
    case("logit-bias-nested", C, hi(logit_bias={"5": [1]}), "logit_bias"),
    case("20k-bad-words", C, hi(bad_words=[f"w{i}" for i in range(20_000)]), "bad_words"),
    case("200k-allowed-ids", C, hi(allowed_token_ids=list(range(200_000))), "allowed_token_ids"),
    case("n-over-cap", C, hi(n=limits.MAX_N + 1), "n"),
    case("prompts-times-n", C, _j({"prompt": ["hi"] * 200, "n": 128}), "n"),
    case("100k-prompts", C, _j({"prompt": [[1]] * 100_000}), "prompt"),
    case("max-tokens-past-context", C, hi(max_tokens=10**6), "max_tokens"),
    case("top-logprobs-over-cap", CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    case("logprobs-over-cap", C, hi(logprobs=21), "logprobs"),
    case("seed-over-64-bits", C, hi(seed=2**64), "seed"),
    case("best-of-not-n", C, hi(best_of=5), "best_of"),
    case("12MB-text-prompt", C, _j({"prompt": "paint " * 2_000_000}), "input_tokens"),
    case("12MB-tokenize", TOK, _j({"prompt": "paint " * 2_000_000}), "input_tokens"),
    case("12MB-chat-message", CHAT, chat(user("a " * 6_000_000)), "input_tokens"),
    # bodies that are not a request object
    case("10000-nested-arrays", C, b"[" * 10_000 + b"]" * 10_000),
    case("10000-nested-in-field", C, b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
    case("10000-nested-objects", C, b'{"prompt": "hi", "x": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001),
    case("not-json", C, b"hello world"),
    case("truncated-json", C, b'{"prompt": "hi", "max_tokens": '),
    case("top-level-array", C, b"[1, 2, 3]"),
    case("top-level-string", C, b'"hi"'),
    case("top-level-null", C, b"null"),
    case("top-level-number", CHAT, b"42"),
    case("empty-body", C, b""),
    case("text-plain", C, hi(), ctype="text/plain"),
    case("form-encoded", C, b"prompt=hi&max_tokens=1", ctype="application/x-www-form-urlencoded"),
    case("xml", CHAT, b"<messages><m role='user'>hi</m></messages>", ctype="application/xml"),
    case("duplicate-keys-last-bad", C, b'{"prompt": "hi", "prompt": 5}', "prompt"),
    case("duplicate-keys-n", C, b'{"prompt": "hi", "n": 1, "n": -3}', "n"),
    case("very-long-model-name", C, hi(model="m" * 1_000_000), "model", status=404),
    case("wrong-type-stream", C, hi(stream="sometimes"), "stream"),
    case("wrong-type-stream-options", C, hi(stream=True, stream_options=5), "stream_options"),
    case("wrong-type-user", C, hi(user={"a": 1}), "user"),
    case("wrong-type-priority", C, hi(priority=1.5), "priority"),
    case("wrong-type-sampling-extra", C, hi(bad_words={"a": 1}), "bad_words"),
    case("body-over-size-cap", C, _j({"prompt": "x" * (17 << 20)}), status=413),
]  # fmt: skip

# Odd but valid: text is text, and roles the template renders.
ACCEPTED = [
    pytest.param(C, hi(prompt="a\x00b\x01\x07\x1b[31m\x7f", max_tokens=2), id="nul-and-control-chars"),
    pytest.param(CHAT, chat(user("\x00"), max_tokens=2), id="nul-in-chat"),
    pytest.param(CHAT, chat([{"role": "tool", "content": "hi"}], max_tokens=2), id="tool-role"),
    pytest.param(CHAT, chat([{"role": "assistant", "content": "hi"}], max_tokens=2), id="assistant-only"),
    pytest.param(CHAT, chat(user(None), max_tokens=2), id="null-content"),
    pytest.param(C, b'{"prompt": 5, "prompt": "hi", "max_tokens": 2}', id="duplicate-keys-last-good"),
    pytest.param(C, hi(max_tokens=2, zzz=[[{}]]), id="unknown-fields-ignored"),
    pytest.param(C, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}', id="surrogate-pair-emoji"),
]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def log_start(server) -> int:
    """Where the server log stood before this module's requests."""
    return len(server.log())


def check_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert len(r.content) < 4096, "an error body echoes a request cut short"
    if param is not None:
        assert err["param"] == param, err


def _post(server, path: str, body: bytes, content_type: str) -> httpx.Response:
    headers = dict(server.headers)
    headers["Content-Type"] = content_type or "application/json"
    return httpx.post(server.url + path, content=body, headers=headers, timeout=TIMEOUT_S)


@pytest.mark.parametrize("path,body,content_type,status,param", HOSTILE)
def test_hostile_request_is_a_4xx(server, path, body, content_type, status, param):
    check_error(_post(server, path, body, content_type), status, param)


@pytest.mark.parametrize("path,body", ACCEPTED)
def test_odd_but_valid_request_is_served(server, path, body):
    r = _post(server, path, body, "application/json")
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"]


def test_healthy_after_hostile_requests(server, log_start):
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    r = httpx.post(server.url + C, json=body, headers=server.headers, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    log = server.log()[log_start:]
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
