"""The FastAPI application: routes, API-key and body-size guard, CORS, error handlers.

Invariants:
- with API keys configured, every path but the open ones (`/health`, `/ping`, `/metrics`,
  `/version`) needs `Authorization: Bearer <key>` for one of them; the given key is compared
  with every configured key in constant time (digests of equal length, no early exit);
- a body larger than the cap is refused with 413 before the app sees it, whether its size is
  declared (Content-Length) or not (chunked);
- CORS is closed unless allowed origins are configured: no CORS headers at all by default;
- while the engine process is dead, generation requests are refused at once (503).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware

from impasto import __version__
from impasto.entrypoints.openai.errors import (
    APIError,
    as_api_error,
    error_body,
    install_error_handlers,
)
from impasto.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from impasto.entrypoints.openai.serving import ServerState
from impasto.entrypoints.openai.serving_chat import chat_prompt_ids, create_chat_completion
from impasto.entrypoints.openai.serving_completion import create_completion

DEFAULT_MAX_BODY_BYTES = 16 << 20
_OPEN_PATHS = {"/health", "/ping", "/metrics", "/version"}  # reachable without an API key


@dataclass(frozen=True)
class CorsSettings:
    """Starlette's CORSMiddleware settings (vLLM's flag names); no origins: CORS closed."""

    allowed_origins: Sequence[str] = ()
    allowed_methods: Sequence[str] = ("GET", "POST")
    allowed_headers: Sequence[str] = ("Authorization", "Content-Type")
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError(
                "allow_credentials with the '*' origin would let any web page make "
                "credentialed requests: list the allowed origins instead."
            )


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class KeyChecker:
    """Constant-time check of a bearer token against every configured key: each comparison is
    of two SHA-256 digests (equal lengths, so the key's length does not leak) and all of them
    run, whatever matched, so timing does not tell which key (or how many) matched."""

    def __init__(self, api_keys: Sequence[str]) -> None:
        self._digests = [_digest(k.encode()) for k in api_keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: bytes) -> bool:
        scheme, _, token = authorization.partition(b" ")
        given = _digest(token.strip())
        ok = False
        for expected in self._digests:
            ok |= hmac.compare_digest(given, expected)
        return ok and scheme.lower() == b"bearer"


class GuardMiddleware:
    """Pure ASGI (streaming-safe): the API keys (`KeyChecker`) and a body-size cap.
    The body is read here, up to the cap, then replayed to the app; later `receive()` calls
    (client-disconnect detection) go to the server as usual."""

    def __init__(self, app: Any, api_keys: Sequence[str], max_body_bytes: int) -> None:
        self.app = app
        self.keys = KeyChecker(api_keys)
        self.max_body = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.keys.enabled and scope["path"] not in _OPEN_PATHS:
            if not self.keys.check(headers.get(b"authorization", b"")):
                await _reply(send, 401, "Invalid or missing API key.", "api_key")
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body:
            await _reply(send, 413, f"Request body larger than {self.max_body} bytes.")
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body:
                await _reply(send, 413, f"Request body larger than {self.max_body} bytes.")
                return
            chunks.append(body)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _reply(send: Any, status: int, message: str, param: str | None = None) -> None:
    body = json.dumps(error_body(message, status, param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def build_app(
    state: ServerState,
    api_keys: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    cors: CorsSettings | None = None,
) -> FastAPI:
    app = FastAPI(title="impasto", version=__version__, docs_url=None, redoc_url=None)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_keys=list(api_keys), max_body_bytes=max_body_bytes)
    if cors is not None and cors.allowed_origins:
        # Added last, so outermost: preflights are answered before the key check, and the
        # guard's 401 / 413 replies carry the CORS headers a browser needs to read them.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
        )
    client = state.client

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if client.is_alive else 503)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> ModelList:
        cards = [
            ModelCard(id=name, root=client.model_path, max_model_len=client.max_model_len)
            for name in state.served_model_names
        ]
        return ModelList(data=cards)

    @app.get("/metrics")
    async def metrics() -> Response:
        snapshot = None
        if client.is_alive:
            try:
                snapshot = (await client.call_utility("metrics", timeout_s=5.0))["metrics"]
            except Exception:  # noqa: BLE001 - serve the last known engine values
                snapshot = None
        return Response(state.metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        state.check_model(req.model)
        if state.tokenizer is None:
            raise APIError("this server has no tokenizer.", 400)
        if req.messages is not None:
            ids = chat_prompt_ids(
                state,
                req.messages,
                req.add_generation_prompt,
                template_kwargs=req.chat_template_kwargs,
                tools=req.tools,
            )
        elif req.prompt is not None:
            state.check_text(req.prompt)
            ids = state.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        else:
            raise APIError("either prompt or messages is required.", 400, "prompt")
        return {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        state.check_model(req.model)
        if state.tokenizer is None:
            raise APIError("this server has no tokenizer.", 400)
        bad = [t for t in req.tokens if not 0 <= t < client.vocab_size]
        if bad:
            raise APIError(f"Token id {bad[0]} is out of vocabulary.", 400, "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    async def generate(handler, req, raw: Request) -> Response:
        """Run a generation endpoint: fail fast when the engine is dead, and give every
        failure an OpenAI error body."""
        if not client.is_alive:
            raise APIError("The engine process is dead; the server is shutting down.", 503)
        try:
            return await handler(state, req, raw)
        except Exception as e:  # noqa: BLE001
            raise as_api_error(e) from e

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await generate(create_completion, req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        return await generate(create_chat_completion, req, raw)

    @app.get("/")
    async def root() -> JSONResponse:
        return JSONResponse({"name": "impasto", "version": __version__, "models": "/v1/models"})

    return app
