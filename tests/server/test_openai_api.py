"""The OpenAI-compatible API through the official `openai` client."""

from __future__ import annotations

import httpx

from tests.server.conftest import metric_values, wait_idle

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def _prompt_tokens(server, prompt: str) -> int:
    r = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=server.headers)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_models_health_version(server):
    client = server.openai()
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert models[0].max_model_len == 512
    assert httpx.get(server.url + "/health").status_code == 200
    assert "version" in httpx.get(server.url + "/version").json()


def test_completion_usage_and_stream_equivalence(server):
    client = server.openai()
    out = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, **GREEDY
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == _prompt_tokens(server, PROMPT)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    assert out.id.startswith("cmpl-")

    chunks = list(
        client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, stream=True,
            stream_options={"include_usage": True}, **GREEDY,
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes.count("length") == 1 and finishes[-1] == "length"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0].choices == []
    assert usage_chunks[0].usage.completion_tokens == 8
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != out.id


def test_chat_stream_and_not(server):
    client = server.openai()
    msgs = [{"role": "user", "content": "Say hello."}]
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=msgs, max_completion_tokens=10, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 10 or out.choices[0].finish_reason == "stop"
    tok = httpx.post(server.url + "/tokenize", json={"messages": msgs}, headers=server.headers)
    assert out.usage.prompt_tokens == tok.json()["count"]
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_n_and_seeded_sampling(server):
    client = server.openai()
    kw = dict(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, temperature=1.0)
    kw["extra_body"] = {"ignore_eos": True}
    a = client.completions.create(n=3, seed=1234, **kw)
    b = client.completions.create(n=3, seed=1234, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 18
    assert len({c.text for c in a.choices}) > 1  # children get distinct seeds
    others = [client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)]
    assert len(set(others + [a.choices[0].text])) > 1  # the seed matters


def test_stop_strings(server):
    client = server.openai()
    kw = dict(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full.strip()[3:6]
    assert stop
    out = client.completions.create(stop=[stop], **kw).choices[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    streamed = client.completions.create(stop=stop, stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed) == out.text


def test_logprobs(server):
    client = server.openai()
    out = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    assert all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)
    # Greedy: the sampled token is the most likely one.
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)


def test_tokenize_detokenize(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=server.headers)
    ids = r.json()["tokens"]
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=server.headers)
    assert r.json()["prompt"] == PROMPT


def test_metrics_move(server):
    before = wait_idle(server)
    client = server.openai()
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=5, **GREEDY)
    after = wait_idle(server)
    key = ("impasto:generation_tokens_total", ())
    assert after[key] - before[key] == 5
    assert after[("impasto:prompt_tokens_total", ())] > before[("impasto:prompt_tokens_total", ())]
    done = ("impasto:request_success_total", (("finished_reason", "length"),))
    assert after[done] - before.get(done, 0) == 1
    count = ("impasto:time_to_first_token_seconds_count", ())
    assert after[count] - before[count] == 1
    assert ("impasto:e2e_request_latency_seconds_bucket", (("le", "+Inf"),)) in after
    assert ("impasto:prefix_cache_queries_total", ()) in after
    assert ("impasto:num_preemptions_total", ()) in after
    assert metric_values(server)[("impasto:kv_cache_usage_perc", ())] == 0


def test_allowed_token_ids_and_bad_words_over_http(server):
    """vLLM's sampling extras arrive through `extra_body` with no server-side field list."""
    client = server.openai()
    ids = httpx.post(
        server.url + "/tokenize", json={"prompt": " Paris London Rome"}, headers=server.headers
    ).json()["tokens"]
    extra = {"ignore_eos": True, "allowed_token_ids": ids}
    out = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, temperature=0.0,
        extra_body=extra,
    )  # fmt: skip
    r = httpx.post(server.url + "/tokenize", json={"prompt": out.choices[0].text},
                   headers=server.headers)  # fmt: skip
    assert set(r.json()["tokens"]) <= set(ids)
    free = (
        client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, **GREEDY
        )
        .choices[0]
        .text
    )
    word = free.split()[0]
    banned = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, temperature=0.0,
        extra_body={"ignore_eos": True, "bad_words": [word]},
    ).choices[0].text  # fmt: skip
    assert word not in banned.split() and banned != free
