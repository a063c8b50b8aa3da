"""The flags of a typical `vllm serve` command line that impasto's own flags do not cover.

A vLLM launch script must start `impasto serve` unchanged, and nothing may be silently
ignored, so every flag here is one of three kinds:
- implemented (`--gpu-memory-utilization`, `--chat-template`, `--generation-config`,
  `--override-generation-config`, `--uvicorn-log-level`, `--ssl-*`, `--root-path`,
  `--enable-log-requests` / `--disable-log-requests`, `--trust-request-chat-template`, ...);
- meaningless on a CPU engine or already impasto's behaviour: accepted with a one-line warning
  that says why (`--enforce-eager`, `--swap-space`, `--trust-remote-code`, ...);
- tool calling and reasoning: `--enable-auto-tool-choice`, `--tool-call-parser`,
  `--tool-parser-plugin`, `--reasoning-parser` (parsers in `openai/tool_parsers.py` and
  `openai/reasoning_parsers.py`);
- meaningful but not available here (a parallelism, KV dtype or load format impasto lacks):
  refused at start with an error that names the flag, unless given its no-op value.
Unknown flags still fail (argparse), as they do in vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("impasto")

# (flag, argparse kwargs, why it changes nothing here)
_NO_OP: list[tuple[str, dict[str, Any], str]] = [
    ("--enforce-eager", dict(action="store_true"), "impasto has no CUDA graphs to disable"),
    ("--swap-space", dict(type=float), "preempted requests are recomputed, never swapped"),
    ("--cpu-offload-gb", dict(type=float), "the weights already live in CPU memory"),
    ("--trust-remote-code", dict(action="store_true"), "impasto never runs a model's code"),
    ("--disable-custom-all-reduce", dict(action="store_true"), "there is no GPU all-reduce"),
    ("--max-seq-len-to-capture", dict(type=int), "impasto has no CUDA graphs"),
    ("--compilation-config", dict(type=str), "impasto does not torch.compile the model"),
    ("--download-dir", dict(type=str), "models come from local paths or `impasto download`"),
    ("--revision", dict(type=str), "models are local files: there is no revision to pick"),
    ("--code-revision", dict(type=str), "impasto never runs a model's code"),
    ("--tokenizer-revision", dict(type=str), "tokenizers are local files"),
    ("--disable-frontend-multiprocessing", dict(action="store_true"),
     "the engine always runs in its own process"),
    ("--enable-prompt-tokens-details", dict(action="store_true"),
     "usage.prompt_tokens_details is always reported when there are cached tokens"),
]  # fmt: skip
# flag -> (its values that ask for nothing impasto lacks, what impasto cannot do otherwise)
_ONLY: dict[str, tuple[tuple[str, ...], str]] = {
    "--pipeline-parallel-size": (("1",), "pipeline parallelism"),
    "--kv-cache-dtype": (("auto",), "a KV cache dtype other than the model's (--dtype)"),
    "--load-format": (("auto", "gguf", "safetensors"), "that load format"),
    "--tokenizer-mode": (("auto", "hf"), "that tokenizer mode"),
}


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_vllm_serve_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM compatibility")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        metavar="FRACTION",
        help="the fraction of the memory available at start given to the KV cache "
        "(unless --kv-cache-memory-bytes or --num-gpu-blocks-override is set)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (Jinja) or the path of a file holding one; replaces the model's",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests carry their own chat_template (refused otherwise, as in vLLM)",
    )
    g.add_argument("--generation-config", default=None, help="auto (default), vllm, or a folder")
    g.add_argument("--override-generation-config", type=_json_object, default=None)
    g.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    g.add_argument("--ssl-keyfile", default=None)
    g.add_argument("--ssl-certfile", default=None)
    g.add_argument("--ssl-ca-certs", default=None)
    g.add_argument("--root-path", default=None, help="the path prefix behind a proxy")
    logs = g.add_mutually_exclusive_group()
    logs.add_argument(
        "--enable-log-requests", action="store_true", help="log each request's admission"
    )
    logs.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log requests (the default)",
    )
    for flag, kwargs, _why in _NO_OP:
        g.add_argument(flag, default=None, help=argparse.SUPPRESS, **kwargs)
    for flag in _ONLY:
        g.add_argument(flag, default=None, help=argparse.SUPPRESS)
    tools = p.add_argument_group("tool calling and reasoning")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='parse tool calls out of outputs for tool_choice "auto" (needs --tool-call-parser)',
    )
    tools.add_argument("--tool-call-parser", default=None, help="hermes, llama3_json, ...")
    tools.add_argument(
        "--tool-parser-plugin",
        default=None,
        metavar="FILE",
        help="a Python file that registers more parsers (@register_tool_parser)",
    )
    tools.add_argument("--reasoning-parser", default=None, help="qwen3, deepseek_r1, ...")


@dataclass
class VllmServeOptions:
    """What the vLLM flags set, resolved: engine keyword arguments and server settings (the
    parsers by name; the server looks them up)."""

    engine: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    uvicorn_log_level: str | None = None
    ssl: dict[str, str] = field(default_factory=dict)
    root_path: str = ""
    log_requests: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


def _attr(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def resolve_vllm_serve_flags(args: argparse.Namespace) -> VllmServeOptions:
    """Check the vLLM flags (SystemExit naming a flag impasto cannot honour), warn once for
    each flag that changes nothing here, and return what the others set."""
    out = VllmServeOptions()
    _resolve_parsers(args, out)
    for flag, (allowed, what) in _ONLY.items():
        value = getattr(args, _attr(flag))
        if value is not None and str(value) not in allowed:
            raise SystemExit(
                f"impasto serve: {flag} {value}: impasto does not support {what} "
                f"(accepted: {', '.join(allowed)})."
            )
    for flag, _kwargs, why in _NO_OP:
        if getattr(args, _attr(flag)) not in (None, False):
            logger.warning("%s is accepted and changes nothing: %s.", flag, why)
    if args.generation_config is not None:
        out.engine["generation_config"] = args.generation_config
    if args.override_generation_config is not None:
        out.engine["override_generation_config"] = args.override_generation_config
    fraction = args.gpu_memory_utilization
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise SystemExit("impasto serve: --gpu-memory-utilization must be in (0, 1].")
        if args.kv_cache_memory_bytes is None and args.num_gpu_blocks_override is None:
            out.engine["kv_cache_memory_bytes"] = int(fraction * available_memory_bytes())
    if args.chat_template is not None:
        out.chat_template = load_chat_template(args.chat_template)
    out.trust_request_chat_template = args.trust_request_chat_template
    out.uvicorn_log_level = args.uvicorn_log_level
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        if getattr(args, name) is not None:
            out.ssl[name] = getattr(args, name)
    if bool(out.ssl.get("ssl_keyfile")) != bool(out.ssl.get("ssl_certfile")):
        raise SystemExit("impasto serve: --ssl-keyfile and --ssl-certfile go together.")
    out.root_path = args.root_path or ""
    out.log_requests = args.enable_log_requests
    return out


def _resolve_parsers(args: argparse.Namespace, out: VllmServeOptions) -> None:
    from impasto.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from impasto.entrypoints.openai.tool_parsers import TOOL_PARSERS

    if args.tool_parser_plugin is not None:
        _import_plugin(args.tool_parser_plugin)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("impasto serve: --enable-auto-tool-choice needs --tool-call-parser.")
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        raise SystemExit(
            f"impasto serve: --tool-call-parser {args.tool_call_parser}: unknown "
            f"(known: {', '.join(TOOL_PARSERS)}; more with --tool-parser-plugin)."
        )
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise SystemExit(
            f"impasto serve: --reasoning-parser {args.reasoning_parser}: unknown "
            f"(known: {', '.join(REASONING_PARSERS)})."
        )
    out.enable_auto_tool_choice = args.enable_auto_tool_choice
    out.tool_call_parser = args.tool_call_parser
    out.reasoning_parser = args.reasoning_parser


def _import_plugin(path: str) -> None:
    """Run a parser plugin file (it registers its parsers on import), as vLLM does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("impasto_tool_parser_plugin", path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise SystemExit(f"impasto serve: --tool-parser-plugin: cannot load {path!r}.")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def load_chat_template(value: str) -> str:
    """A template given inline, or the path of a file holding one (vLLM's rule: a value that
    names an existing file is read)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{%"):
        return value
    raise SystemExit(f"impasto serve: --chat-template: no file {value!r}, nor a template.")


def available_memory_bytes() -> int:
    """Memory available now (Linux's MemAvailable; the physical total elsewhere)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
