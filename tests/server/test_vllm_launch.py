"""A `vllm serve` command line, as vLLM's docs write one, starts `impasto serve` unchanged:
flags with a meaning here take effect (TLS, several served names, a chat template, generation
defaults and overrides, the KV cache's share of memory, uvicorn's log level), flags without one
are accepted with a one-line warning, and flags asking for what impasto lacks, or unknown
flags, stop the start with an error naming them."""

from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import pytest

from .conftest import start_server

pytestmark = pytest.mark.slow

KEY = "token-abc123"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)  # no default system prompt, unlike the model's own template


def _self_signed(tmp) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(key), str(cert)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_line")
    key, cert = _self_signed(tmp)
    (tmp / "template.jinja").write_text(TEMPLATE)
    line = [
        "--dtype", "auto", "--gpu-memory-utilization", "0.05", "--max-model-len", "512",
        "--enforce-eager", "--swap-space", "4", "--trust-remote-code",
        "--disable-log-requests", "--uvicorn-log-level", "warning",
        "--chat-template", str(tmp / "template.jinja"), "--generation-config", "auto",
        "--override-generation-config", '{"temperature": 0.0}',
        "--served-model-name", "smol", "smol-alias", "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "1", "--kv-cache-dtype", "auto",
        "--ssl-keyfile", key, "--ssl-certfile", cert, "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
    ]  # fmt: skip
    srv = start_server(tmp, api_key=KEY, extra=line, scheme="https")
    try:
        yield srv
    finally:
        srv.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=srv.headers, timeout=60, verify=False)


def test_the_vllm_line_takes_effect(vllm_server):
    srv = vllm_server
    models = httpx.get(srv.url + "/v1/models", headers=srv.headers, verify=False).json()
    assert [m["id"] for m in models["data"]] == ["smol", "smol-alias"]
    # The chat template replaced the model's: no default system prompt in the prompt.
    msgs = [{"role": "user", "content": "Hi"}]
    ids = _post(srv, "/tokenize", {"messages": msgs}).json()["tokens"]
    text = _post(srv, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # The override makes requests that leave temperature unset greedy: repeatable.
    body = {"model": "smol-alias", "messages": msgs, "max_tokens": 12}
    first = _post(srv, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    again = _post(srv, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    greedy = {**body, "temperature": 0.0}
    explicit = _post(srv, "/v1/chat/completions", greedy).json()["choices"][0]["message"]
    assert first == again == explicit["content"]
    log = srv.log()
    for flag in ("--enforce-eager", "--swap-space", "--trust-remote-code"):
        assert f"{flag} is accepted and changes nothing" in log
    assert "INFO:     Uvicorn running" not in log  # --uvicorn-log-level warning


def test_per_request_chat_template_needs_trust(vllm_server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "chat_template": "{{ messages[0]['content'] }}"}  # fmt: skip
    r = _post(vllm_server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
        (["--tool-call-parser", "nope"], "--tool-call-parser nope: unknown"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--reasoning-parser", "nope"], "--reasoning-parser nope: unknown"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_flags_impasto_cannot_honour_stop_the_start(flags, expected):
    cmd = [sys.executable, "-m", "impasto.entrypoints.cli", "serve", "--port", "1", *flags]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert expected in run.stderr
