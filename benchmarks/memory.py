"""Peak resident memory of an `LLM` on the default model, and the KV cache sized from its budget.

    python benchmarks/memory.py                    # bf16, KV budgets of 1 GiB and 256 MiB

Each budget runs in a fresh child process (peak RSS is per process): load the model, allocate
the KV cache from `kv_cache_memory_bytes`, generate 16 prompts of 64-256 tokens with 128 new
tokens each. Prints the KV cache's actual size, the weights' size and the peak RSS; the second
budget is the same-run baseline: the peak RSS should move by the KV difference and no more.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

GiB = 1 << 30


def child(kv_bytes: int, dtype: str) -> None:
    import numpy as np

    from impasto import LLM, SamplingParams

    llm = LLM(dtype=dtype, kv_cache_memory_bytes=kv_bytes, max_model_len=1024, seed=0)
    runner = llm.llm_engine.runner
    kv = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, size=int(n)).tolist() for n in rng.integers(64, 257, 16)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"kv": kv, "weights": weights, "peak": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budgets-mib", type=int, nargs="+", default=[1024, 256])
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.dtype)
        return
    print("| KV budget | KV cache allocated | weights | peak RSS | peak RSS - KV |")
    print("|---:|---:|---:|---:|---:|")
    for mib in args.budgets_mib:
        cmd = [sys.executable, __file__, "--dtype", args.dtype, "--child", str(mib << 20)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"| {mib} MiB | {r['kv'] / GiB:.3f} GiB | {r['weights'] / GiB:.3f} GiB | "
            f"{r['peak'] / GiB:.2f} GiB | {(r['peak'] - r['kv']) / GiB:.2f} GiB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
