"""Logprobs over HTTP as lm-evaluation-harness and vLLM clients use them: `echo` with
`logprobs` scores the prompt (first position null), `max_tokens: 0` with `echo` scores it alone,
`prompt_logprobs`, `return_token_ids`, `return_tokens_as_token_ids`, streamed and not, all
consistent with one another and with a plain generation of the same tokens."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog"


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)


def _complete(server, **body) -> dict:
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream(
        "POST", server.url + path, json={**body, "stream": True}, headers=server.headers
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(server):
    body = _complete(server, echo=True, max_tokens=0, logprobs=2, prompt_logprobs=2)
    choice, usage = body["choices"][0], body["usage"]
    assert choice["text"] == PROMPT
    assert usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"]
    lp = choice["logprobs"]
    n = usage["prompt_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == PROMPT
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # The same numbers as vLLM's prompt_logprobs field of the same request.
    ids = _post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    prompt_lps = choice["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == n
    for pos in range(1, n):
        entry = prompt_lps[pos][str(ids[pos])]
        assert entry["logprob"] == pytest.approx(lp["token_logprobs"][pos], abs=1e-6)
        assert len(lp["top_logprobs"][pos]) <= 3  # the top 2 and the prompt token


def test_echoed_logprobs_continue_into_the_completion(server):
    plain = _complete(server, max_tokens=4, logprobs=1)["choices"][0]
    echoed = _complete(server, max_tokens=4, logprobs=1, echo=True)
    choice = echoed["choices"][0]
    n = echoed["usage"]["prompt_tokens"]
    assert choice["text"] == PROMPT + plain["text"]
    lp, ref = choice["logprobs"], plain["logprobs"]
    assert lp["tokens"][n:] == ref["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(ref["token_logprobs"], abs=1e-6)
    assert lp["text_offset"][n] == len("".join(lp["tokens"][:n]))
    streamed = _stream(server, "/v1/completions", {
        "prompt": PROMPT, "temperature": 0, "max_tokens": 4, "logprobs": 1, "echo": True,
    })  # fmt: skip
    tokens = [t for c in streamed for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert tokens == lp["tokens"]
    assert "".join(c["choices"][0]["text"] for c in streamed) == choice["text"]


def test_max_tokens_zero_without_echo_is_a_400(server):
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_return_token_ids_and_tokens_as_ids(server):
    ids = _post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    body = _complete(server, max_tokens=5, return_token_ids=True, logprobs=0,
                     return_tokens_as_token_ids=True)  # fmt: skip
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 5
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]

    msgs = [{"role": "user", "content": "Say hello."}]
    chat = {"messages": msgs, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["prompt_token_ids"]) == out["usage"]["prompt_tokens"]
    token_ids = out["choices"][0]["token_ids"]
    assert len(token_ids) == out["usage"]["completion_tokens"]
    chunks = _stream(server, "/v1/chat/completions", chat)
    assert chunks[0]["prompt_token_ids"] == out["prompt_token_ids"]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert streamed == token_ids


def test_chat_prompt_logprobs(server):
    msgs = [{"role": "user", "content": "Say hello."}]
    body = {"messages": msgs, "max_tokens": 2, "prompt_logprobs": 0, "return_token_ids": True}
    out = _post(server, "/v1/chat/completions", body).json()
    lps, ids = out["prompt_logprobs"], out["prompt_token_ids"]
    assert lps[0] is None and len(lps) == len(ids)
    assert all(list(lps[i]) == [str(ids[i])] for i in range(1, len(ids)))


def test_whole_vocabulary_logprobs_over_the_cap_are_a_400(server):
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
