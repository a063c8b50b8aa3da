"""`impasto bench serve`: an OpenAI-API load generator for any compatible server.

Arrivals are Poisson at `--request-rate` (gamma with `--burstiness`; `inf` sends all at once),
optionally capped by `--max-concurrency`. Every request streams; measured on the client:
TTFT (send -> first content), ITL (gaps between content chunks), TPOT ((E2EL - TTFT) /
(output tokens - 1)) and E2EL (send -> end). Token counts come from the server's usage chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from impasto.bench.datasets import (
    BenchRequest,
    corpus_requests,
    prefix_repetition_requests,
    random_requests,
)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


async def _one(session, url: str, body: dict, headers: dict) -> RequestResult:
    import aiohttp

    res = RequestResult()
    start = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = str(chunk["error"].get("message"))[:200]
                        return res
                    if chunk.get("usage"):
                        res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        res.output_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            now = time.perf_counter()
                            if last is None:
                                res.ttft = now - start
                            else:
                                res.itl.append(now - last)
                            last = now
    except (TimeoutError, aiohttp.ClientError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2el = time.perf_counter() - start
    res.ok = last is not None
    if not res.ok:
        res.error = "no output"
    return res


def _body(args: argparse.Namespace, model: str, req: BenchRequest) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def _model_name(session, base: str, headers: dict) -> str:
    async with session.get(f"{base}/v1/models", headers=headers) as resp:
        return (await resp.json())["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict:
    import aiohttp

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or (
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    )
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.dataset_name == "corpus":
        reqs = corpus_requests(
            args.dataset_path, args.num_prompts, args.random_output_len, args.seed
        )
    elif args.dataset_name == "prefix_repetition":
        reqs = prefix_repetition_requests(
            args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, args.seed,
        )  # fmt: skip
    else:
        reqs = random_requests(
            args.num_prompts, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.seed,
        )  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await _model_name(session, base, headers)
        url = base + endpoint
        for w in random_requests(args.num_warmups, 16, 8, 0.0, args.seed + 7919):
            await _one(session, url, _body(args, model, w), headers)
        sem = asyncio.Semaphore(args.max_concurrency or len(reqs) or 1)
        rng = random.Random(args.seed)

        async def limited(req: BenchRequest) -> RequestResult:
            async with sem:
                return await _one(session, url, _body(args, model, req), headers)

        start = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(limited(req)))
            if args.request_rate != float("inf"):
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, args, model)


def _stats(name: str, values: list[float], percentiles: list[float]) -> dict:
    arr = np.asarray(values, dtype=float) * 1000.0 if values else np.zeros(1)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr))}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def summarize(results: list[RequestResult], duration: float, args, model: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    pcts = [float(p) for p in args.metric_percentiles.split(",")]
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "model": model,
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
    }
    summary |= _stats("ttft", [r.ttft for r in ok], pcts)
    summary |= _stats("tpot", tpots, pcts)
    summary |= _stats("itl", [g for r in ok for g in r.itl], pcts)
    summary |= _stats("e2el", [r.e2el for r in ok], pcts)
    summary["per_request"] = [asdict(r) | {"itl": None} for r in results]
    return summary


def format_table(s: dict) -> str:
    rows = [
        ("Successful requests", f"{s['completed']}"),
        ("Failed requests", f"{s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", f"{s['total_input_tokens']}"),
        ("Total generated tokens", f"{s['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
    ]
    lines = ["=" * 50, f"{' Serving Benchmark Result ':=^50}"]
    lines += [f"{k:<36}{v:>14}" for k, v in rows]
    metric_names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st)"}
    metric_names |= {"itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in metric_names.items():
        lines.append(f"{' ' + title + ' ':-^50}")
        for stat, value in s.items():
            if stat.endswith(f"_{key}_ms"):
                label = stat.replace(f"_{key}_ms", "").replace("_", " ").capitalize()
                lines.append(f"{label + ' ' + key.upper() + ' (ms)':<36}{value:>14.2f}")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    lines.append("=" * 50)
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed")
        return
    reqs = [r for r in summary["per_request"] if r["ok"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].hist([r["ttft"] * 1000 for r in reqs], bins=30)
    axes[0].set_xlabel("TTFT (ms)")
    axes[1].hist([r["e2el"] for r in reqs], bins=30)
    axes[1].set_xlabel("end-to-end latency (s)")
    fig.tight_layout()
    fig.savefig(path)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None)
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--dataset-name", default="random", choices=["random", "corpus", "prefix_repetition"]
    )
    p.add_argument("--dataset-path", default=None, help="corpus: JSONL or one prompt per line")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=32)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=8)
    p.add_argument("--prefix-repetition-output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0, help="1.0 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", default="50,99")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--save-result", default=None, metavar="PATH.json")
    p.add_argument("--plot", default=None, metavar="PATH.png")


def main(args: argparse.Namespace) -> int:
    if args.dataset_name == "corpus" and not args.dataset_path:
        raise SystemExit("--dataset-name corpus needs --dataset-path")
    summary = asyncio.run(run_benchmark(args))
    print(format_table(summary))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(summary, f, indent=1)
    if args.plot:
        plot(summary, args.plot)
    return 0 if summary["failed"] == 0 else 1
