"""The measuring children of `benchmarks/quantized.py`: each runs in a fresh process of its
own (`quantized.py --child KIND SPEC OUT`), reads a JSON-able spec and returns a JSON-able
result.

- `impasto_bench`: impasto's B1 / B-n / prefill workloads (best-of-`repeats` runs after a
  same-shape warm-up), its KV cache size and the weight bytes a decode step reads;
- `impasto_spec`: the speculative-decoding target alone and/or with its draft model, at B1;
- `bandwidth`: the machine's memory read bandwidth.

Invariants: `quantized.py` starts one child per process, so the peak RSS (`ru_maxrss`) a child
reports is that of its own engine(s); decoding is greedy with EOS ignored, so every run of a
workload generates the same number of tokens and engines can be compared token for token.
"""

from __future__ import annotations

import gc
import resource
import time
from typing import Any


def _cpu() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    return a.ru_utime + a.ru_stime


def _key(t: Any) -> int:
    try:
        return t.data_ptr()
    except RuntimeError:  # oneDNN-packed (mkldnn) weights have no plain storage
        return id(t)


def decode_weight_bytes(model: Any) -> int:
    """Bytes of weights a decode step streams: every parameter / buffer once (tied ones once),
    except a token embedding that nothing else shares (a step gathers a few of its rows)."""
    names: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    buffers = dict(model.named_buffers())
    tensors = list(model.named_parameters(remove_duplicate=False)) + [
        (name, t)  # a packed segment the kernels read repacked is not read itself
        for name, t in buffers.items()
        if name.rpartition(".")[0] + ".x8_" + name.rpartition(".")[2] not in buffers
    ]
    for name, t in tensors:
        names.setdefault(_key(t), []).append(name)
        sizes[_key(t)] = t.numel() * t.element_size()
    return sum(
        size
        for key, size in sizes.items()
        if not (len(names[key]) == 1 and names[key][0].endswith("embed_tokens.weight"))
    )


def impasto_bench(spec: dict[str, Any]) -> dict[str, Any]:
    from impasto import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec.get("max_model_len", 1024),
        kv_cache_memory_bytes=spec["kv_bytes"],
        enable_prefix_caching=False,
        num_threads=spec["threads"],
        seed=0,
        **spec.get("engine_args", {}),
    )
    load_s = time.perf_counter() - t0
    runner = llm.llm_engine.runner
    res: dict[str, Any] = {
        "load_s": load_s,
        "kv_bytes": sum(t.numel() * t.element_size() for t in runner.kv_caches),
        "decode_weight_bytes": decode_weight_bytes(runner.model),
        "workloads": {},
    }
    for name, w in spec["workloads"].items():
        params = SamplingParams(temperature=0.0, max_tokens=w["new_tokens"], ignore_eos=True)
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
        llm.generate(prompts, warm, use_tqdm=False)  # warm-up: the same shapes, 2 tokens
        runs = []
        for _ in range(spec["repeats"]):
            t0, c0 = time.perf_counter(), _cpu()
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append(
                {
                    "wall_s": time.perf_counter() - t0,
                    "cpu_s": _cpu() - c0,
                    "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                }
            )
        res["workloads"][name] = {
            "runs": runs,
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
        }
    res["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def impasto_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The target alone or with the draft model (`spec["configs"]`: either or both, one after
    the other; the script runs each in its own process so that peak RSS is its own)."""
    from impasto import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    res: dict[str, Any] = {"k": spec["k"]}
    speculative: dict[str, Any] = {
        "method": "draft_model",
        "model": spec["draft"],
        "num_speculative_tokens": spec["k"],
    }
    if spec.get("draft_vocab_size"):  # the draft scores ids below it only (lossless)
        speculative["draft_vocab_size"] = spec["draft_vocab_size"]
    configs = {"baseline": None, "speculative": speculative}
    for name in spec.get("configs", list(configs)):
        cfg = configs[name]
        llm = LLM(
            spec["model"],
            dtype=spec["dtype"],
            max_model_len=spec.get("max_model_len", 1024),
            max_num_seqs=1,
            speculative_config=cfg,
            enable_prefix_caching=False,
            num_threads=spec["threads"],
            seed=0,
            **spec.get("engine_args", {}),
        )
        llm.generate([{"prompt_token_ids": spec["prompts"][0][:8]}], warm, use_tqdm=False)
        before = _spec_counters(llm)
        outs, c0, t0 = [], _cpu(), time.perf_counter()
        for p in spec["prompts"]:  # batch 1: one request at a time
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            outs.append(list(out[0].outputs[0].token_ids))
        wall = time.perf_counter() - t0
        after = _spec_counters(llm)
        steps, drafted, accepted = (a - b for a, b in zip(after, before, strict=True))
        res[name] = {
            "wall_s": wall,
            "cpu_s": _cpu() - c0,
            "tokens": sum(map(len, outs)),
            "outputs": outs,
            "steps": steps,
            "drafted": drafted,
            "accepted": accepted,
        }
        del llm
        gc.collect()
    res["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def _spec_counters(llm: Any) -> tuple[float, float, float]:
    m = {x.name: x.value for x in llm.get_metrics()}
    keys = ("drafts", "draft_tokens", "accepted_tokens")
    return tuple(m.get(f"impasto:spec_decode_num_{k}", 0.0) for k in keys)  # type: ignore[return-value]


def bandwidth(spec: dict[str, Any]) -> dict[str, Any]:
    """Read bandwidth: `sum` over a buffer far larger than the last-level cache, with one
    thread and with all of them (on a shared machine either can be the higher); the best of
    both is the machine's figure."""
    import torch

    x = torch.ones(spec["bytes"] // 4, dtype=torch.float32)
    nbytes = x.numel() * 4
    out: dict[str, Any] = {"bytes": nbytes, "by_threads": {}}
    for threads in sorted({1, spec["threads"]}):
        torch.set_num_threads(threads)
        x.sum()
        times = []
        for _ in range(spec["reps"]):
            t0 = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - t0)
        times.sort()
        out["by_threads"][str(threads)] = {
            "best_gbs": nbytes / times[0] / 1e9,
            "median_gbs": nbytes / times[len(times) // 2] / 1e9,
        }
    out["best_gbs"] = max(v["best_gbs"] for v in out["by_threads"].values())
    return out
