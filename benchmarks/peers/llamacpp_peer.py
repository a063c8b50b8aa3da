"""Run a throughput workload through llama.cpp (llama-cpp-python); print JSON lines.

Used by `benchmarks/throughput.py` via IMPASTO_BENCH_LLAMACPP_PYTHON. llama-cpp-python's
high-level API decodes one sequence at a time, so the offline workload runs sequentially.
"""

import json
import os
import resource
import sys
import time


def _cpu() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def main() -> None:
    from llama_cpp import Llama

    spec = json.load(open(sys.argv[1]))
    llm = Llama(
        model_path=spec["model"], n_ctx=1024, n_threads=os.cpu_count(), verbose=False, seed=0
    )
    n = spec["new_tokens"]
    for name, prompts in spec["workloads"].items():
        t0, c0 = time.perf_counter(), _cpu()
        tokens = 0
        for p in prompts:
            llm.reset()
            count = 0
            for _tok in llm.generate(p, temp=0.0, top_k=1, reset=True):
                count += 1
                if count >= n:
                    break
            tokens += count
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        print(json.dumps({"workload": name, "tokens": tokens, "wall_s": wall, "cpu_s": cpu}))


if __name__ == "__main__":
    main()
