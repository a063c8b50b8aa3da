"""`impasto serve`: bind the port, start the engine process, run uvicorn, shut down cleanly.

Order matters: the port is bound first (a busy port fails in milliseconds, not after loading a
model); the engine process loads the model while this process loads the tokenizer; SIGTERM /
Ctrl-C make uvicorn stop accepting, finish the open requests (up to the shutdown timeout), then
the engine process drains and exits, and `serve()` returns 0.

If the engine process dies on its own (killed, crashed), the open requests fail at once (the
client's sentinel watch), `/health` answers 503, and after `engine_death_grace_s` (so a load
balancer polling /health sees the 503) uvicorn shuts down gracefully and `serve()` returns
`EXIT_ENGINE_DIED`: a supervisor restarts the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
from dataclasses import dataclass, field

import uvicorn

from impasto.config.engine_args import EngineArgs
from impasto.engine.dp_client import make_engine_client
from impasto.entrypoints.openai.app import DEFAULT_MAX_BODY_BYTES, CorsSettings, build_app
from impasto.entrypoints.openai.metrics import ServerMetrics
from impasto.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from impasto.entrypoints.openai.serving import ServerState
from impasto.entrypoints.openai.tool_parsers import get_tool_parser
from impasto.entrypoints.vllm_flags import VllmServeOptions
from impasto.loader.packaged_models import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME, resolve_model

logger = logging.getLogger("impasto")

EXIT_ENGINE_DIED = 3  # serve()'s status when the engine process died under it


@dataclass
class ServeConfig:
    engine_args: EngineArgs
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # none: no authentication
    served_model_name: list[str] = field(default_factory=list)
    log_level: str = "info"
    access_log: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 30.0
    request_timeout: float | None = None  # seconds from arrival; None: no limit
    cors: CorsSettings | None = None  # None or no origins: CORS closed
    engine_death_grace_s: float = 2.0  # /health answers 503 this long before the exit
    vllm: VllmServeOptions = field(default_factory=VllmServeOptions)  # vLLM's flags, resolved


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"impasto serve: cannot listen on {host}:{port}: {e.strerror}") from e
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _banner(cfg: ServeConfig, name: str, port: int, engine_pids: list[int | None]) -> str:
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    url = f"{'https' if cfg.vllm.ssl else 'http'}://{host}:{port}"
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}]})
    auth = " -H 'Authorization: Bearer <API key>'" if cfg.api_keys else ""  # never the key
    return (
        f"impasto is serving {name} at {url}/v1 (OpenAI-compatible; "
        f"engine process pid {', '.join(str(p) for p in engine_pids)})\n"
        f"Try it:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{body}'\n"
    )


async def serve(cfg: ServeConfig) -> int:
    sock = bind_socket(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    args = cfg.engine_args
    model_path = resolve_model(args.model)  # fetches the default model once, before spawning
    default = args.model is None or args.model in DEFAULT_MODEL_ALIASES
    names = cfg.served_model_name or [DEFAULT_MODEL_NAME if default else str(args.model)]
    args = dataclasses.replace(args, model=str(model_path))
    # The engine keeps torch's default threads (all cores): measured on a 2-core machine, one
    # thread left to the API process cost 20-40 % of output tokens/s at every concurrency.
    # With data parallelism the cores are split between the engines (engine/dp_client.py).
    client = make_engine_client(args, log_level=cfg.log_level)
    tokenizer_task = None
    if not args.skip_tokenizer_init:
        from impasto.loader.tokenizer import load_tokenizer

        tokenizer_task = asyncio.create_task(
            asyncio.to_thread(load_tokenizer, args.tokenizer or model_path)
        )
    try:
        await client.start()
    except BaseException:
        sock.close()
        if tokenizer_task is not None:
            tokenizer_task.cancel()
        raise
    tokenizer = await tokenizer_task if tokenizer_task is not None else None
    if tokenizer is not None and cfg.vllm.chat_template is not None:
        tokenizer.chat_template = cfg.vllm.chat_template  # --chat-template replaces the model's
    state = ServerState(
        client,
        tokenizer,
        names,
        ServerMetrics(names[0]),
        priority_scheduling=args.scheduling_policy == "priority",
    )
    state.request_timeout_s = cfg.request_timeout
    state.trust_request_chat_template = cfg.vllm.trust_request_chat_template
    state.log_requests = cfg.vllm.log_requests
    state.enable_auto_tool_choice = cfg.vllm.enable_auto_tool_choice
    if cfg.vllm.tool_call_parser is not None:
        state.tool_parser = get_tool_parser(cfg.vllm.tool_call_parser)
    if cfg.vllm.reasoning_parser is not None:
        state.reasoning_parser = get_reasoning_parser(cfg.vllm.reasoning_parser)
    app = build_app(state, cfg.api_keys, cfg.max_body_bytes, cfg.cors)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.shutdown()

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(
        app,
        log_level=cfg.vllm.uvicorn_log_level or cfg.log_level,
        access_log=cfg.access_log,
        timeout_graceful_shutdown=int(cfg.shutdown_timeout),
        timeout_keep_alive=30,
        root_path=cfg.vllm.root_path,
        **cfg.vllm.ssl,
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it is done: make that harmless, so the
    # engine shutdown below always runs.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    exit_code = 0

    async def exit_when_engine_dies() -> None:
        nonlocal exit_code
        await client.died.wait()
        exit_code = EXIT_ENGINE_DIED
        logger.error(
            "the engine process died (%s): /health answers 503; shutting down in %.1f s "
            "(exit status %d)",
            client.dead_reason,
            cfg.engine_death_grace_s,
            EXIT_ENGINE_DIED,
        )
        await asyncio.sleep(cfg.engine_death_grace_s)
        server.should_exit = True  # uvicorn's graceful shutdown: open requests already failed

    watcher = asyncio.create_task(exit_when_engine_dies(), name="engine-death-watch")
    pids = getattr(client, "engine_pids", [client.engine_pid])
    print(_banner(cfg, names[0], port, pids), flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        await client.shutdown()
        sock.close()
    if exit_code:
        logger.error("exiting with status %d: the engine process died", exit_code)
    return exit_code


def run_server(cfg: ServeConfig) -> int:
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve(cfg))
