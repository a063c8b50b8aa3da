"""The tables `benchmarks/quantized.py` prints: each engine's figures from its children's raw
results (best of the timed runs), one table per model with impasto / llama.cpp ratios and the
distance to the machine's read bandwidth, and the speculative-decoding table."""

from __future__ import annotations

from typing import Any

GiB = 1 << 30


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    """The fastest repeat (a shared machine only ever makes runs slower)."""
    return min(runs, key=lambda r: r["wall_s"])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def summarize(
    res: dict[str, Any], info: dict[str, Any], batch: int, prefill_len: int
) -> dict[str, Any]:
    """The figures of one engine's bench run."""
    w = res["workloads"]
    b1, bn, pf = (
        best(w["batch1"]["runs"]),
        best(w[f"batch{batch}"]["runs"]),
        best(w["prefill"]["runs"]),
    )
    weights = res.get("decode_weight_bytes", info["decode_weight_bytes"])
    b1_tps = b1["tokens"] / b1["wall_s"]
    return {
        "b1_tok_s": b1_tps,
        "b1_cpu_wall": b1["cpu_s"] / b1["wall_s"],
        "bn_tok_s": bn["tokens"] / bn["wall_s"],
        "bn_cpu_wall": bn["cpu_s"] / bn["wall_s"],
        "prefill_s": pf["wall_s"],
        "prefill_tok_s": prefill_len / pf["wall_s"],
        "peak_rss": res["peak_rss"],
        "kv_bytes": res.get("kv_bytes"),
        "load_s": res["load_s"],
        "decode_weight_bytes": weights,
        "b1_weight_gbs": weights * b1_tps / 1e9,
    }


def print_model(
    name: str, info: dict, figs: dict[str, dict], bw: dict | None, extra: dict, shape: dict
) -> None:
    engines = list(figs)
    ref = "llama.cpp" if "llama.cpp" in figs else None
    print(
        f"\n## {name} ({info['arch']}; {info['file_bytes'] / 2**20:.0f} MiB file; "
        f"{', '.join(info['types'])}); greedy, {shape['new_tokens']} new tokens, EOS ignored; "
        f"impasto dtype {shape['impasto_dtype']}"
    )
    if engines:
        print_table(engines, ref, figs, bw, shape)
    for k, v in extra.items():
        print(f"{k}: {v}")


def print_table(
    engines: list[str], ref: str | None, figs: dict[str, dict], bw: dict | None, shape: dict
) -> None:
    head = "| | " + " | ".join(engines) + " |"
    if ref and "impasto" in figs:
        head += " impasto / llama.cpp |"
    print(head)
    print("|---|" + "---:|" * (head.count("|") - 2))

    def row(label: str, key: str, spec: str, scale: float = 1.0) -> None:
        vals = [figs[e].get(key) for e in engines]
        cells = ["-" if v is None else format(v / scale, spec) for v in vals]
        line = f"| {label} | " + " | ".join(cells) + " |"
        if ref and "impasto" in figs:
            a, b = figs["impasto"].get(key), figs[ref].get(key)
            line += f" {a / b:.2f}x |" if a and b else " - |"
        print(line)

    row(f"(a) B1 tok/s ({shape['prompt_len']}-token prompt)", "b1_tok_s", ".1f")
    row(f"(b) B{shape['batch']} tok/s", "bn_tok_s", ".1f")
    row(f"(c) prefill {shape['prefill_len']} tokens, s", "prefill_s", ".3f")
    row("prefill tok/s", "prefill_tok_s", ".0f")
    row("(d) peak RSS, GiB", "peak_rss", ".2f", GiB)
    row("KV cache, GiB", "kv_bytes", ".3f", GiB)
    row("weights read per token, MiB", "decode_weight_bytes", ".0f", 2**20)
    row("B1 weight bandwidth, GB/s", "b1_weight_gbs", ".1f")
    row("cpu/wall B1", "b1_cpu_wall", ".2f")
    row("cpu/wall B16", "bn_cpu_wall", ".2f")
    row("load, s", "load_s", ".2f")
    if bw:
        per = ", ".join(
            f"{t} thread(s): best {v['best_gbs']:.1f} / median {v['median_gbs']:.1f}"
            for t, v in bw["by_threads"].items()
        )
        print(f"machine read bandwidth, GB/s (sum over {bw['bytes'] / GiB:.0f} GiB): {per}")
        for e in engines:
            print(
                f"  {e}: B1 weight bandwidth = "
                f"{figs[e]['b1_weight_gbs'] / bw['best_gbs']:.0%} of the best"
            )


def spec_figures(r: dict[str, Any]) -> dict[str, Any]:
    base, spec = r["baseline"], r["speculative"]
    b_tps, s_tps = base["tokens"] / base["wall_s"], spec["tokens"] / spec["wall_s"]
    same = sum(a == b for a, b in zip(base["outputs"], spec["outputs"], strict=True))
    return {
        "baseline_tok_s": b_tps,
        "spec_tok_s": s_tps,
        "speedup": s_tps / b_tps,
        "acceptance": spec["accepted"] / spec["drafted"] if spec["drafted"] else None,
        "mean_accepted_len": 1 + spec["accepted"] / spec["steps"] if spec["steps"] else None,
        "identical": f"{same}/{len(base['outputs'])}",
        "peak_rss": r["peak_rss"],
    }


def print_spec(title: str, figs: dict[str, dict]) -> None:
    print(f"\n## (e) {title}")
    print(
        "| engine | target alone tok/s | speculative tok/s | speedup | acceptance | "
        "mean accepted length | outputs = own greedy | peak RSS GiB (target + draft) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for e, f in figs.items():
        acc = "-" if f["acceptance"] is None else f"{f['acceptance']:.0%}"
        mal = "-" if f["mean_accepted_len"] is None else f"{f['mean_accepted_len']:.2f}"
        print(
            f"| {e} | {f['baseline_tok_s']:.1f} | {f['spec_tok_s']:.1f} | {f['speedup']:.2f}x | "
            f"{acc} | {mal} | {f['identical']} | {f['peak_rss'] / GiB:.2f} |"
        )
    if "impasto" in figs and "llama.cpp" in figs:
        a, b = figs["impasto"], figs["llama.cpp"]
        print(
            f"impasto / llama.cpp: target alone {a['baseline_tok_s'] / b['baseline_tok_s']:.2f}x, "
            f"speculative {a['spec_tok_s'] / b['spec_tok_s']:.2f}x"
        )
