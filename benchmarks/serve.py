"""Online serving: `impasto bench serve` against `impasto serve` and, in the same run, `vllm serve`.

    python benchmarks/serve.py                                   # impasto only
    IMPASTO_BENCH_VLLM_PYTHON=/path/to/python python benchmarks/serve.py   # + vLLM (CPU build)

Same model (SmolLM2-135M-Instruct; vLLM gets an HF folder exported from the same GGUF), same
dtype, same client, same prompts (random text, `--input-len` words, `--output-len` tokens with
EOS ignored, greedy), at each concurrency in `--concurrency` (rate = inf, capped by the
concurrency). Each server is started fresh and warmed up once; prompts differ between runs so
the prefix cache does not carry over. Prints one table with impasto / vLLM ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from impasto.bench.serve import add_cli_args, run_benchmark  # noqa: E402
from impasto.bench.server_process import free_port, stop_server, wait_healthy  # noqa: E402


def _start(cmd: list[str], port: int, log: Path, env: dict, timeout_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
    try:
        healthy = wait_healthy(proc, f"http://127.0.0.1:{port}", timeout_s, poll_s=0.5)
    except RuntimeError as e:
        raise RuntimeError(f"{cmd[0]}: {e}: see {log}") from None
    if not healthy:
        stop_server(proc, timeout_s=10)
        raise RuntimeError(f"server did not start in {timeout_s} s: see {log}")
    return proc


def _bench(port: int, conc: int, num: int, args: argparse.Namespace, seed: int) -> dict:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    bargs = parser.parse_args(
        ["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(num),
         "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
         "--max-concurrency", str(conc), "--ignore-eos", "--seed", str(seed),
         "--num-warmups", "2"]
    )  # fmt: skip
    return asyncio.run(run_benchmark(bargs))


def run_engine(name: str, cmd: list[str], port: int, env: dict, args) -> dict[int, dict]:
    log = Path(args.log_dir) / f"{name}-server.log"
    print(f"starting {name}: {' '.join(cmd)}", flush=True)
    proc = _start(cmd, port, log, env, args.startup_timeout)
    results = {}
    try:
        for conc in args.concurrency:
            num = max(args.min_prompts, conc * args.prompts_per_slot)
            results[conc] = _bench(port, conc, num, args, seed=1000 + conc)
            r = results[conc]
            print(
                f"  {name} c={conc}: {r['output_throughput']:.1f} out tok/s, "
                f"p99 TTFT {r['p99_ttft_ms']:.0f} ms, failed {r['failed']}",
                flush=True,
            )
    finally:
        stop_server(proc, timeout_s=60)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prompts-per-slot", type=int, default=1)
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--num-threads", type=int, default=None, help="impasto engine torch threads")
    args = p.parse_args()

    from impasto.loader.packaged_models import ensure_default_model

    gguf = ensure_default_model()
    env = dict(os.environ)
    all_results: dict[str, dict[int, dict]] = {}
    port = free_port()
    cmd = [sys.executable, "-m", "impasto.entrypoints.cli", "serve", "--port", str(port),
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--disable-uvicorn-access-log", "--log-level", "warning"]  # fmt: skip
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    all_results["impasto"] = run_engine("impasto", cmd, port, env, args)

    vllm_python = os.environ.get("IMPASTO_BENCH_VLLM_PYTHON")
    if vllm_python:
        sys.path.insert(0, str(HERE))
        from throughput import export_hf_folder

        folder = export_hf_folder(gguf, args.dtype)
        port = free_port()
        venv_bin = str(Path(vllm_python).parent)
        venv_env = dict(env, PATH=f"{venv_bin}:{env.get('PATH', '')}")
        venv_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        # The API-server module directly: the CLI wrapper needs package metadata that some
        # builds (e.g. the CPU wheel) register under another name.
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--port", str(port), "--dtype", args.dtype, "--max-model-len",
               str(args.max_model_len), "--served-model-name", "SmolLM2-135M-Instruct",
               "--disable-uvicorn-access-log", "--disable-log-stats"]  # fmt: skip
        try:
            all_results["vllm"] = run_engine("vllm", cmd, port, venv_env, args)
        except RuntimeError as e:
            print(f"vLLM run failed: {e}")
    print_table(all_results)


def print_table(results: dict[str, dict[int, dict]]) -> None:
    imp = results["impasto"]
    peer = results.get("vllm", {})
    print("\n| concurrency | engine | out tok/s | req/s | TTFT p50 / p99 ms | "
          "TPOT p50 / p99 ms | ITL p50 / p99 ms | E2EL p50 / p99 s | failed |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for conc in imp:
        for name, r in (("impasto", imp[conc]), ("vLLM", peer.get(conc))):
            if r is None:
                continue
            print(
                f"| {conc} | {name} | {r['output_throughput']:.1f} | "
                f"{r['request_throughput']:.2f} | "
                f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                f"{r['median_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} | "
                f"{r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} | "
                f"{r['median_e2el_ms'] / 1000:.2f} / {r['p99_e2el_ms'] / 1000:.2f} | "
                f"{r['failed']} |"
            )
        if conc in peer:
            a, b = imp[conc], peer[conc]
            print(
                f"| {conc} | impasto / vLLM | "
                f"{a['output_throughput'] / b['output_throughput']:.2f}x | | "
                f"p99 TTFT {a['p99_ttft_ms'] / b['p99_ttft_ms']:.2f}x | | | | |"
            )


if __name__ == "__main__":
    main()
