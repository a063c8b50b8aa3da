"""llama.cpp (llama-cpp-python) on a GGUF file: teacher-forced logits, greedy throughput,
prefill and draft-model speculative decoding. Writes one JSON file.

    /path/to/llamacpp-venv/bin/python llamacpp_gguf.py spec.json

Run by `benchmarks/gguf_agreement.py` and `benchmarks/quantized.py` under the python of a
virtualenv that has llama-cpp-python; imports nothing of impasto. The spec is JSON:
`{"mode": "logits" | "bench" | "info", "model": PATH, "out": PATH, "threads": N, ...}`.

- logits: `windows` (token id lists) are evaluated with `logits_all=True`; per scored position
  (every position but a window's last) we keep the argmax, the top-2 logit gap, the NLL of the
  next token and the top-`k` ids / logprobs. `kv_type` "f16" (llama.cpp's default) or "f32"
  is the KV cache's type.
- bench: `workloads` {name: {"prompts": [[ids]], "new_tokens": n}}; each runs greedy (EOS
  ignored) through the low-level batch API, all prompts as parallel sequences of one context
  (one `llama_decode` per step), `repeats` times after a warm-up, plus up to `max_retries`
  reruns of runs whose CPU/wall fell below `retry_below` (a shared machine).
- spec: greedy draft-model speculative decoding (`draft` model, `k` drafted tokens per step,
  verified by the target in one batch; rejected KV cells removed), and the target alone.
"""

import ctypes
import json
import os
import resource
import sys
import time

import numpy as np


def _cpu() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    return a.ru_utime + a.ru_stime


def _info() -> dict:
    import llama_cpp

    return {
        "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    }


def logit_stats(logits: np.ndarray, next_ids: np.ndarray, k: int) -> dict:
    """Rows of logits [P, V] (fp32) and the ids that follow -> per-row argmax, top-2 gap,
    next-token NLL, top-k ids and logprobs."""
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0].astype(np.float64) + np.log(np.exp(logits - m).sum(axis=1, dtype=np.float64))
    top = np.argpartition(-logits, k, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(logits, top, axis=1), axis=1, kind="stable")
    top = np.take_along_axis(top, order, axis=1)
    top_logits = np.take_along_axis(logits, top, axis=1).astype(np.float64)
    rows = np.arange(len(next_ids))
    return {
        "argmax": top[:, 0].tolist(),
        "gap": (top_logits[:, 0] - top_logits[:, 1]).tolist(),
        "nll": (lse - logits[rows, next_ids].astype(np.float64)).tolist(),
        "top_ids": top.tolist(),
        "top_lps": (top_logits - lse[:, None]).tolist(),
    }


# ggml's type ids for the KV cache types the logits mode offers.
KV_TYPES = {"f32": 0, "f16": 1}


def run_logits(spec: dict) -> dict:
    from llama_cpp import Llama

    windows = spec["windows"]
    width = max(map(len, windows))
    llm = Llama(
        model_path=spec["model"],
        n_ctx=width,
        n_batch=width,
        n_ubatch=width,
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        logits_all=True,
        verbose=False,
        seed=0,
        type_k=KV_TYPES[spec.get("kv_type", "f16")],
        type_v=KV_TYPES[spec.get("kv_type", "f16")],
    )
    out: dict = {"argmax": [], "gap": [], "nll": [], "top_ids": [], "top_lps": []}
    t0 = time.perf_counter()
    for ids in windows:
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids) - 1], dtype=np.float32)
        for key, val in logit_stats(logits, np.asarray(ids[1:]), spec.get("k", 8)).items():
            out[key] += val
    out["wall_s"] = time.perf_counter() - t0
    if spec.get("text") is not None:
        out["text_ids"] = llm.tokenize(spec["text"].encode(), add_bos=False, special=False)
    return out


class Engine:
    """A model and one context with `n_seq` sequences of `n_ctx_seq` cells each."""

    def __init__(self, path: str, threads: int, n_seq: int, n_ctx_seq: int, n_batch: int):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_seq * n_ctx_seq
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_ctx = int(L.llama_n_ctx(self.ctx))
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model)))
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, n_seq)
        self.mem = L.llama_get_memory(self.ctx)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)

    def seq_rm(self, seq: int, p0: int) -> None:
        self.L.llama_memory_seq_rm(self.mem, seq, p0, -1)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """items: (token, pos, seq, want_logits), at most n_batch; the wanted logits rows."""
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = want
        b.n_tokens = len(items)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = []
        for i, (*_, want) in enumerate(items):
            if want:
                ptr = self.L.llama_get_logits_ith(self.ctx, i)
                arr = np.ctypeslib.as_array(
                    ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
                )
                rows.append(arr)
        return rows

    def prefill(self, prompts: list[list[int]], seqs: list[int] | None = None) -> list[int]:
        """Each prompt into its sequence (packed into batches of n_batch tokens); the greedy
        next token of each."""
        seqs = seqs if seqs is not None else list(range(len(prompts)))
        items = [
            (t, pos, s, pos == len(p) - 1)
            for p, s in zip(prompts, seqs, strict=True)
            for pos, t in enumerate(p)
        ]
        firsts: list[int] = []
        for i in range(0, len(items), self.n_batch):
            firsts += [int(r.argmax()) for r in self.decode(items[i : i + self.n_batch])]
        return firsts

    def greedy(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
        """All prompts as parallel sequences; (generated ids, seconds of the prefill)."""
        self.clear()
        t0 = time.perf_counter()
        nxt = self.prefill(prompts)
        t_prefill = time.perf_counter() - t0
        outs = [[t] for t in nxt]
        pos = [len(p) for p in prompts]
        for _ in range(new_tokens - 1):
            items = [(o[-1], pos[s], s, True) for s, o in enumerate(outs)]
            for s, row in enumerate(self.decode(items)):
                outs[s].append(int(row.argmax()))
                pos[s] += 1
        return outs, t_prefill


def run_bench(spec: dict) -> dict:
    workloads = spec["workloads"]
    n_seq = max(len(w["prompts"]) for w in workloads.values())
    n_ctx_seq = max(max(map(len, w["prompts"])) + w["new_tokens"] for w in workloads.values())
    n_ctx_seq = -(-(n_ctx_seq + 8) // 256) * 256
    t0 = time.perf_counter()
    eng = Engine(spec["model"], spec["threads"], n_seq, n_ctx_seq, spec.get("n_batch", 512))
    load_s = time.perf_counter() - t0
    results = {}
    for name, w in workloads.items():
        eng.greedy(w["prompts"], 2)  # warm-up: the same shapes, 2 tokens
        runs: list[dict] = []
        retries = 0
        while len(runs) - retries < spec.get("repeats", 1):
            t0, c0 = time.perf_counter(), _cpu()
            outs, t_prefill = eng.greedy(w["prompts"], w["new_tokens"])
            wall = time.perf_counter() - t0
            runs.append(
                {
                    "wall_s": wall,
                    "cpu_s": _cpu() - c0,
                    "prefill_s": t_prefill,
                    "tokens": sum(map(len, outs)),
                }
            )
            # Its OpenMP threads spin: CPU/wall well below the thread count means another
            # process held our cores (a run then slows several-fold); run again, keep the best.
            if runs[-1]["cpu_s"] < spec.get("retry_below", 0.0) * wall:
                if retries < spec.get("max_retries", 0):
                    retries += 1
        results[name] = {"runs": runs, "outputs": outs, "retries": retries}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"load_s": load_s, "n_ctx": eng.n_ctx, "workloads": results, "peak_rss": peak}


def run_spec(spec: dict, engine=Engine) -> dict:
    """Greedy speculative decoding, batch 1: the draft proposes k tokens one by one, the
    target scores [last, d1..dk] in one decode, the longest agreeing prefix plus the target's
    own next token are kept, and both caches drop what was rejected."""
    k, n_new = spec["k"], spec["new_tokens"]
    n_ctx = -(-(max(map(len, spec["prompts"])) + n_new + k + 8) // 256) * 256
    tgt = engine(spec["model"], spec["threads"], 1, n_ctx, 512)
    dft = engine(spec["draft"], spec["threads"], 1, n_ctx, 512)

    def plain(prompt: list[int], counts: list[int], n_new: int = n_new) -> list[int]:
        return tgt.greedy([prompt], n_new)[0][0]

    def speculative(prompt: list[int], counts: list[int], n_new: int = n_new) -> list[int]:
        tgt.clear()
        dft.clear()
        out = [tgt.prefill([prompt])[0]]
        dft.prefill([prompt[:-1]])  # the draft catches up on the last token below
        d_pos = len(prompt) - 1  # next position the draft has not seen
        seq = list(prompt) + out  # everything committed
        while len(out) < n_new:
            kk = min(k, n_new - len(out))
            drafts: list[int] = []
            pending = seq[d_pos:]  # committed tokens the draft has not seen yet
            row = dft.decode(
                [(t, d_pos + i, 0, i == len(pending) - 1) for i, t in enumerate(pending)]
            )
            d_pos += len(pending)
            for j in range(kk):
                drafts.append(int(row[0].argmax()))
                if j < kk - 1:
                    row = dft.decode([(drafts[-1], d_pos, 0, True)])
                    d_pos += 1
            base = len(seq) - 1
            rows = tgt.decode([(t, base + i, 0, True) for i, t in enumerate([seq[-1]] + drafts)])
            preds = [int(r.argmax()) for r in rows]
            n_ok = 0
            while n_ok < kk and drafts[n_ok] == preds[n_ok]:
                n_ok += 1
            counts[0] += 1
            counts[1] += kk
            counts[2] += n_ok
            new = drafts[:n_ok] + [preds[n_ok]]
            new = new[: n_new - len(out)]
            out += new
            seq += new
            tgt.seq_rm(0, base + 1 + n_ok)  # keep KV of seq[-1] and the accepted drafts
            d_pos = min(d_pos, base + 1 + n_ok)
            dft.seq_rm(0, d_pos)
        return out

    res: dict = {"k": k}
    for name, fn in (("baseline", plain), ("speculative", speculative)):
        fn(spec["prompts"][0][:8], [0, 0, 0], 4)  # warm-up
        counts = [0, 0, 0]  # steps, drafted, accepted
        outs = []
        t0, c0 = time.perf_counter(), _cpu()
        for p in spec["prompts"]:
            outs.append(fn(p, counts))
        res[name] = {
            "wall_s": time.perf_counter() - t0,
            "cpu_s": _cpu() - c0,
            "tokens": sum(map(len, outs)),
            "outputs": outs,
            "steps": counts[0],
            "drafted": counts[1],
            "accepted": counts[2],
        }
    res["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    spec.setdefault("threads", os.cpu_count())
    mode = spec.get("mode", "info")
    result = {"info": _info()}
    if mode == "logits":
        result.update(run_logits(spec))
    elif mode == "bench":
        result.update(run_bench(spec))
    elif mode == "spec":
        result.update(run_spec(spec))
    with open(spec["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
