"""Security of the HTTP server: several API keys (flags and IMPASTO_API_KEY) checked in constant
time, 500 bodies without internals (an error id instead), CORS closed by default and opened by
vLLM's flags, and the body-size cap (413, declared or chunked).

In-process tests cover the pieces (key checker, error handlers, CLI parsing); one real server
(`secured`) covers them end to end, and the shared `server` shows the defaults.
"""

from __future__ import annotations

import logging
import re

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from impasto.engine import engine_process
from impasto.entrypoints import cli
from impasto.entrypoints.openai import app as app_module
from impasto.entrypoints.openai.app import CorsSettings, KeyChecker
from impasto.entrypoints.openai.errors import install_error_handlers
from tests.server.conftest import start_server

FLAG_KEYS, ENV_KEYS = ["k-one", "k-two"], ["k-three", "k-four"]
ORIGIN, EVIL = "https://app.example", "https://evil.example"
MAX_BODY = 4096
ERROR_ID = re.compile(r"^Internal server error \(error id [0-9a-f]{12}\)\.$")


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    extra = ["--api-key", FLAG_KEYS[0], "--api-key", FLAG_KEYS[1]]
    extra += ["--allowed-origins", ORIGIN, "--allow-credentials"]
    extra += ["--max-request-body-bytes", str(MAX_BODY)]
    env = {"IMPASTO_API_KEY": f" {ENV_KEYS[0]}, {ENV_KEYS[1]} ,"}
    srv = start_server(tmp_path_factory.mktemp("secured"), api_key=None, extra=extra, env=env)
    try:
        yield srv
    finally:
        srv.stop()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _check_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


# -- in-process ---------------------------------------------------------------------------------
def test_api_keys_from_flags_and_env():
    assert cli.api_keys(["a", " b "], " c, ,d,a") == ["a", "b", "c", "d"]
    assert cli.api_keys(None, None) == [] and cli.api_keys(None, " , ") == []
    assert cli._list_arg("https://a.example, https://b.example") == [
        "https://a.example",
        "https://b.example",
    ]
    assert cli._list_arg('["*"]') == ["*"]


def test_help_documents_the_env_var(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "IMPASTO_API_KEY" in text and "comma-separated list of keys" in text
    for flag in ("--allowed-origins", "--allow-credentials", "--request-timeout"):
        assert flag in text
    assert "--max-waiting-requests" in text


def test_key_checker_compares_every_key(monkeypatch):
    keys = ["alpha", "beta-longer-key", "g"]
    checker = KeyChecker(keys)
    for key in keys:
        assert checker.check(f"Bearer {key}".encode())
        assert checker.check(f"bearer {key}".encode())
    for bad in (b"", b"Bearer", b"Bearer alph", b"Bearer alphaa", b"Basic alpha", b"alpha"):
        assert not checker.check(bad)
    calls = []
    real = app_module.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", counting)
    assert checker.check(b"Bearer alpha")  # matches the first key: no early exit
    assert calls == [(32, 32)] * 3  # one comparison per key, of equal-length digests
    assert not KeyChecker([]).enabled


def test_cors_refuses_credentials_with_any_origin():
    with pytest.raises(ValueError, match="credentialed"):
        CorsSettings(allowed_origins=["*"], allow_credentials=True)
    with pytest.raises(SystemExit, match="allow-credentials"):
        cli.main(["serve", "--allowed-origins", "*", "--allow-credentials"])


def test_500_body_is_generic_and_logged_under_its_id(caplog):
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret detail in /srv/models/private.py line 12")

    with caplog.at_level(logging.ERROR, logger="impasto"):
        r = TestClient(app, raise_server_exceptions=False).get("/boom")
    err = _check_error(r, 500)
    assert ERROR_ID.match(err["message"]), err
    for leak in ("RuntimeError", "secret", "/srv", "private.py", "Traceback"):
        assert leak not in r.text
    error_id = err["message"].split("error id ")[1].rstrip(").")
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1])  # details stay server-side


def test_engine_failure_message_is_generic(caplog):
    with caplog.at_level(logging.ERROR, logger="impasto"):
        try:
            raise KeyError("/opt/weights/layer.bin")
        except KeyError:
            message = engine_process._internal_error("step failed")
    assert re.fullmatch(
        r"Internal server error: the engine failed this request \(error id [0-9a-f]{12}\)\.",
        message,
    )
    error_id = message.split("error id ")[1].rstrip(").")
    assert any(error_id in r.getMessage() and "layer.bin" in r.getMessage() for r in caplog.records)


# -- a real server ------------------------------------------------------------------------------
def test_every_key_accepted(secured):
    for key in FLAG_KEYS + ENV_KEYS:
        r = httpx.get(secured.url + "/v1/models", headers=_bearer(key), timeout=30)
        assert r.status_code == 200, (key, r.text)
    body = {"prompt": "hi", "max_tokens": 1}
    r = httpx.post(secured.url + "/v1/completions", json=body, headers=_bearer("k-four"))
    assert r.status_code == 200, r.text
    log = secured.log()
    assert not any(key in log for key in FLAG_KEYS + ENV_KEYS)  # the banner shows no key


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer k-on", "Bearer k-one2", "Basic k-one", "Bearer " + "k-two" * 200,
     "Bearer k-three,k-four", "Bearer"],
)  # fmt: skip
def test_wrong_keys_refused(secured, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    r = httpx.get(secured.url + "/v1/models", headers=headers, timeout=30)
    err = _check_error(r, 401)
    assert not any(key in err["message"] for key in FLAG_KEYS + ENV_KEYS)
    assert httpx.get(secured.url + "/health", timeout=30).status_code == 200  # open


def test_validation_errors_still_name_the_parameter(secured):
    body = {"prompt": "hi", "temperature": -1}
    r = httpx.post(secured.url + "/v1/completions", json=body, headers=_bearer("k-one"))
    assert _check_error(r, 400)["param"] == "temperature"


def test_cors_allowed_origin(secured):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(secured.url + "/v1/completions", headers=preflight, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.get(secured.url + "/v1/models", headers={"Origin": ORIGIN} | _bearer("k-two"))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(secured.url + "/v1/models", headers={"Origin": ORIGIN})  # no key: a 401...
    _check_error(r, 401)
    assert r.headers["access-control-allow-origin"] == ORIGIN  # ...that the page can read


def test_cors_other_origin_refused(secured):
    preflight = {"Origin": EVIL, "Access-Control-Request-Method": "POST"}
    r = httpx.options(secured.url + "/v1/completions", headers=preflight, timeout=30)
    assert r.status_code == 400
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(secured.url + "/v1/models", headers={"Origin": EVIL} | _bearer("k-one"))
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_closed_by_default(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    responses = [
        httpx.options(server.url + "/v1/completions", headers=preflight, timeout=30),
        httpx.get(server.url + "/health", headers={"Origin": ORIGIN}, timeout=30),
        httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN} | server.headers),
    ]
    for r in responses:
        assert not [h for h in r.headers if h.lower().startswith("access-control-")], r.headers


def test_body_size_cap(secured):
    headers = _bearer("k-one") | {"Content-Type": "application/json"}
    url = secured.url + "/tokenize"
    fits = b'{"prompt": "' + b"a" * (MAX_BODY - 100) + b'"}'
    r = httpx.post(url, content=fits, headers=headers, timeout=30)
    assert r.status_code == 200, r.text  # under the cap: served
    big = b'{"prompt": "' + b"a" * (MAX_BODY + 1000) + b'"}'
    r = httpx.post(url, content=big, headers=headers, timeout=30)  # declared Content-Length
    assert _check_error(r, 413)["message"] == f"Request body larger than {MAX_BODY} bytes."

    def chunks():
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    r = httpx.post(url, content=chunks(), headers=headers, timeout=30)  # no length: chunked
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in r.request.headers
    _check_error(r, 413)
    r = httpx.post(url, content=chunks(), headers=_bearer("k-one"))
    _check_error(r, 413)
    assert httpx.get(secured.url + "/health").status_code == 200
