"""vLLM (its CPU build) on a GGUF file: greedy throughput and prefill, the workloads of
`benchmarks/quantized.py`. Writes one JSON file, in the shape of `llamacpp_gguf.py`'s bench mode.

    /path/to/vllm-venv/bin/python vllm_gguf.py spec.json

Run by `benchmarks/quantized.py` under the python of a virtualenv that has vLLM; imports nothing
of impasto. The spec is JSON: `{"model": PATH, "out": PATH, "threads": N, "workloads": {name:
{"prompts": [[ids]], "new_tokens": n}}, "repeats": R, "kv_gib": G}`.

vLLM loads a GGUF file through its `gguf` quantization (config and tokenizer read from the file
by transformers) where the installed vLLM has that method. Where it cannot load the file (vLLM
0.32 has no `gguf` method: it reads the path as a folder's config), the driver writes
`{"error": ..., "has_gguf_method": ...}` with vLLM's own message instead of figures, so the
report can say why vLLM has no column.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the peak RSS and the
CPU time measured here are the whole engine's; its OpenMP threads are bound to all `threads`
cores (`VLLM_CPU_OMP_THREADS_BIND`, none reserved), as llama.cpp and impasto use them.
"""

import json
import os
import resource
import sys
import time
import traceback


def _cpu() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    return a.ru_utime + a.ru_stime


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    workloads = spec["workloads"]
    longest = max(max(map(len, w["prompts"])) + w["new_tokens"] for w in workloads.values())
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        max_model_len=longest + 8,
        max_num_seqs=max(len(w["prompts"]) for w in workloads.values()),
        max_num_batched_tokens=max(2048, longest + 8),
        seed=0,
    )
    load_s = time.perf_counter() - t0
    results = {}
    for name, w in workloads.items():
        n = w["new_tokens"]
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
        warm = SamplingParams(temperature=0.0, max_tokens=2, min_tokens=2, ignore_eos=True)
        llm.generate(prompts, warm, use_tqdm=False)  # the same shapes, 2 tokens
        runs = []
        for _ in range(spec.get("repeats", 1)):
            t0, c0 = time.perf_counter(), _cpu()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            runs.append(
                {
                    "wall_s": wall,
                    "cpu_s": _cpu() - c0,
                    "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                }
            )
        results[name] = {
            "runs": runs,
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "retries": 0,
        }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    import vllm

    return {
        "load_s": load_s,
        "workloads": results,
        "peak_rss": peak,
        "version": vllm.__version__,
    }


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    threads = spec["threads"]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_gib", 1)))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        out = run(spec)
    except Exception as e:  # vLLM's own message, for the report
        import vllm
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

        lines = [ln for ln in traceback.format_exception_only(type(e), e) if ln.strip()]
        out = {
            "error": lines[-1].strip()[:2000],
            "version": vllm.__version__,
            "has_gguf_method": "gguf" in QUANTIZATION_METHODS,
        }
    with open(spec["out"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
