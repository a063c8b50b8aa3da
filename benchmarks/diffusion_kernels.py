"""The vocabulary-sized work of a DiffusionGemma denoising step, piece by piece, in one run.

    python benchmarks/diffusion_kernels.py                  # 256 rows (canvas 64 x batch 4)
    python benchmarks/diffusion_kernels.py --rows 1024 --vocab 262144 --hidden 2560

Each row pairs the way impasto does a piece with its baseline, timed interleaved (median of
`--repeats`), so the ratio holds on a noisy machine:

- the sampler's per-position pass (grid snap, softmax, entropy, inverse-CDF draw, argmax over
  [rows, vocab]): the CPU kernel against the eager PyTorch path;
- soft-capping: the CPU kernel against eager `div_ / tanh_ / mul_`;
- the LM head and self-conditioning products: one call over all rows (into a kept buffer)
  against one call per canvas of `--canvas` rows (what the runner did per request before);
- the LM head product with oneDNN-packed weights against MKL (the GEMM both engines use).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from impasto import kernels  # noqa: E402
from impasto.worker.diffusion.sampler import GRID, denoise_rows  # noqa: E402


def timed(pair: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each callable, run interleaved after one warm-up each."""
    for fn in pair.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in pair}
    for _ in range(repeats):
        for k, fn in pair.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=256, help="canvas positions in the step")
    ap.add_argument("--canvas", type=int, default=64, help="rows per canvas")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernels.load()
    if ops is None:
        sys.exit("the CPU kernels are unavailable (no compiler, or IMPASTO_CPU_KERNELS=0)")
    g = torch.Generator().manual_seed(0)
    r, v, h, c = args.rows, args.vocab, args.hidden, args.canvas
    logits = torch.randn(r, v, generator=g) * 3
    scale = torch.full((r,), GRID / 0.6)
    u = torch.rand(r, generator=g)
    work = torch.empty_like(logits)
    emb = torch.randn(v, h, generator=g)  # the tied embedding [V, H]
    hid = torch.randn(r, h, generator=g)
    probs = torch.softmax(logits, -1)

    def fresh() -> torch.Tensor:
        return work.copy_(logits)  # each pass consumes its input (in place)

    rows: list[tuple[str, str, str, dict[str, float], float]] = []

    def add(piece: str, ours: str, base: str, t: dict[str, float], fma: float = 0.0) -> None:
        rows.append((piece, ours, base, t, fma))

    t = timed(
        {
            "kernel": lambda: denoise_rows(fresh(), scale, u, ops),
            "eager": lambda: denoise_rows(fresh(), scale, u, None),
            "copy": fresh,  # the input refresh, subtracted from both
        },
        args.repeats,
    )
    add("per-position pass", "kernel", "eager", {k: t[k] - t["copy"] for k in ("kernel", "eager")})
    t = timed(
        {
            "kernel": lambda: ops.softcap_(fresh(), 30.0),
            "eager": lambda: fresh().div_(30.0).tanh_().mul_(30.0),
            "copy": fresh,
        },
        args.repeats,
    )
    add("soft-capping", "kernel", "eager", {k: t[k] - t["copy"] for k in ("kernel", "eager")})
    chunks = [slice(i, min(i + c, r)) for i in range(0, r, c)]
    t = timed(
        {
            "one call": lambda: torch.mm(hid, emb.t(), out=work),
            "per canvas": lambda: [torch.nn.functional.linear(hid[s], emb) for s in chunks],
        },
        args.repeats,
    )
    add("LM head product", "one call", "per canvas", t, r * h * v)
    t = timed(
        {
            "one call": lambda: probs @ emb,
            "per canvas": lambda: [probs[s] @ emb for s in chunks],
        },
        args.repeats,
    )
    add("self-conditioning product", "one call", "per canvas", t, r * h * v)
    if torch.backends.mkldnn.is_available():  # oneDNN's packed fp32 GEMM, where torch has it
        packed = torch.ops.mkldnn._reorder_linear_weight(emb, None)
        t = timed(
            {
                "MKL": lambda: torch.mm(hid, emb.t(), out=work),
                "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(
                    hid, packed, None, "none", [], ""
                ),
            },
            args.repeats,
        )
        add("LM head product", "MKL", "oneDNN", t, r * h * v)

    print(f"rows {r} (canvases of {c}), vocab {v}, hidden {h}, {args.threads} thread(s)\n")
    print("| piece | impasto | ms | baseline | ms | baseline / impasto | GFMA/s (impasto) |")
    print("|---|---|---:|---|---:|---:|---:|")
    for piece, ours, base, t, fma in rows:
        rate = f"{fma / t[ours] / 1e9:.1f}" if fma else ""
        print(
            f"| {piece} | {ours} | {t[ours] * 1e3:.1f} | {base} | {t[base] * 1e3:.1f} | "
            f"{t[base] / t[ours]:.2f} | {rate} |"
        )


if __name__ == "__main__":
    main()
