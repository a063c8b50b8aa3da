"""Run a throughput workload through vLLM (CPU build) in its own Python; print JSON lines.

Used by `benchmarks/throughput.py` via IMPASTO_BENCH_VLLM_PYTHON; never imported by impasto.
"""

import json
import resource
import sys
import time


def _cpu() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def main() -> None:
    from vllm import LLM, SamplingParams

    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=1024, max_num_seqs=64, seed=0)
    n = spec["new_tokens"]
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [100] * 8}], params, use_tqdm=False)
    for name, prompts in spec["workloads"].items():
        t0, c0 = time.perf_counter(), _cpu()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"workload": name, "tokens": tokens, "wall_s": wall, "cpu_s": cpu}))


if __name__ == "__main__":
    main()
