"""Data parallelism on a shared-prefix load: DP=2 (a core each) against DP=1 (both cores), and
prefix-aware routing against round-robin, in the same run.

    python benchmarks/data_parallel.py [--concurrency 32] [--num-prompts 128]
    python benchmarks/data_parallel.py --num-prefixes 32 --num-prompts 320 --blocks-per-engine 272
        (docs/benchmarks.md's table: each engine's cache holds about half of the prefixes)

Each configuration is a fresh `impasto serve` of the default model (SmolLM2-135M-Instruct,
packed Q4_1, bf16 activations) driven by `impasto bench serve` with the `prefix_repetition`
load: `--num-prefixes` system prompts of `--prefix-len` words, each request one of them and its
own question, greedy, EOS ignored. The KV cache is sized in blocks (`--blocks-per-engine`, DP=1
gets the sum) so that one engine holds about half of the prefixes next to its running requests:
the regime where routing decides the hit rate (with room for every prefix everywhere, any
routing hits nearly always after the first pass). Prefix-cache hit rates come from the engines'
own counters (/metrics, summed over engines, the warm-up excluded). Prints one table, ratios
against DP=1.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from impasto.bench.serve import add_cli_args, run_benchmark  # noqa: E402
from impasto.bench.server_process import free_port, stop_server, wait_healthy  # noqa: E402

CONFIGS = [  # (name, data-parallel size, routing)
    ("DP=1", 1, None),
    ("DP=2 prefix-aware", 2, "prefix_aware"),
    ("DP=2 round-robin", 2, "round_robin"),
    ("DP=2 least-loaded", 2, "least_loaded"),
]


def cache_counters(url: str) -> tuple[float, float, float]:
    """(hit tokens, queried tokens, balance overrides) summed over the engines."""
    from prometheus_client.parser import text_string_to_metric_families

    hits = queries = overrides = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "impasto:prefix_cache_hits_total":
                hits += s.value
            elif s.name == "impasto:prefix_cache_queries_total":
                queries += s.value
            elif s.name == "impasto:router_balance_overrides_total":
                overrides += s.value
    return hits, queries, overrides


def run_config(name: str, dp: int, routing: str | None, args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    blocks = args.blocks_per_engine * (2 if dp == 1 else 1)  # the same memory in all
    cmd = [
        sys.executable,
        "-m",
        "impasto.entrypoints.cli",
        "serve",
        "--port",
        str(port),
        "--data-parallel-size",
        str(dp),
        "--num-gpu-blocks-override",
        str(blocks),
        "--max-model-len",
        "1024",
        "--disable-uvicorn-access-log",
        "--log-level",
        "warning",
    ]
    if routing:
        cmd += ["--data-parallel-routing", routing]  # fmt: skip
    for flag in ("router_balance_abs_threshold", "router_balance_rel_threshold",
                 "router_cache_threshold"):  # fmt: skip
        if routing == "prefix_aware" and getattr(args, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    log = Path(args.log_dir) / f"dp{dp}-{routing or 'single'}.log"
    print(f"starting {name}", flush=True)
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        if not wait_healthy(proc, url, 300, poll_s=0.5):
            raise RuntimeError(f"{name} did not start: see {log}")
        parser = argparse.ArgumentParser()
        add_cli_args(parser)
        bargs = parser.parse_args(
            ["--base-url", url, "--dataset-name", "prefix_repetition",
             "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
             "--prefix-repetition-prefix-len", str(args.prefix_len),
             "--prefix-repetition-suffix-len", str(args.suffix_len),
             "--prefix-repetition-num-prefixes", str(args.num_prefixes),
             "--prefix-repetition-output-len", str(args.output_len),
             "--ignore-eos", "--num-warmups", "2", "--seed", "11"]
        )  # fmt: skip
        h0, q0, o0 = cache_counters(url)  # before the warm-ups: they share no prefix, so they only
        result = asyncio.run(run_benchmark(bargs))  # add misses to every configuration alike
        h1, q1, o1 = cache_counters(url)
        result["hit_rate"] = (h1 - h0) / max(q1 - q0, 1.0)
        result["overrides"] = o1 - o0
    finally:
        stop_server(proc, timeout_s=60)
    print(
        f"  {name}: {result['output_throughput']:.1f} out tok/s, "
        f"p99 TTFT {result['p99_ttft_ms']:.0f} ms, hit rate {result['hit_rate']:.2f}, "
        f"balance overrides {result['overrides']:.0f}, failed {result['failed']}",
        flush=True,
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=200)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--blocks-per-engine", type=int, default=192)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--router-balance-abs-threshold", type=int, default=None)
    p.add_argument("--router-balance-rel-threshold", type=float, default=None)
    p.add_argument("--router-cache-threshold", type=float, default=None)
    p.add_argument(
        "--configs", nargs="+", default=[c[0] for c in CONFIGS], choices=[c[0] for c in CONFIGS],
        help="a subset of the configurations (DP=1 and both DP=2 routings always run)",
    )  # fmt: skip
    args = p.parse_args()
    needed = {"DP=1", "DP=2 prefix-aware", "DP=2 round-robin"}
    chosen = [c for c in CONFIGS if c[0] in set(args.configs) | needed]
    results = {name: run_config(name, dp, routing, args) for name, dp, routing in chosen}
    base = results["DP=1"]
    print(
        f"\nshared-prefix load: {args.num_prompts} requests, {args.num_prefixes} prefixes x "
        f"{args.prefix_len} words + {args.suffix_len}, {args.output_len} tokens out, "
        f"concurrency {args.concurrency}, {args.blocks_per_engine} KV blocks per engine"
    )
    print(f"{'config':<20} {'out tok/s':>10} {'x DP=1':>7} {'req/s':>7} {'p99 TTFT ms':>12} "
          f"{'x DP=1':>7} {'hit rate':>9}")  # fmt: skip
    for name, r in results.items():
        print(
            f"{name:<20} {r['output_throughput']:>10.1f} "
            f"{r['output_throughput'] / base['output_throughput']:>7.2f} "
            f"{r['request_throughput']:>7.2f} {r['p99_ttft_ms']:>12.0f} "
            f"{r['p99_ttft_ms'] / base['p99_ttft_ms']:>7.2f} {r['hit_rate']:>9.2f}"
        )
    pa, rr = results["DP=2 prefix-aware"], results["DP=2 round-robin"]
    print(
        f"\nprefix-aware / round-robin: hit rate {pa['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x,"
        f" throughput {pa['output_throughput'] / rr['output_throughput']:.2f}x"
    )


if __name__ == "__main__":
    main()
