"""impasto's fused CPU kernels against the eager PyTorch they replace, in the same run.

    python benchmarks/cpu_kernels.py [--rows 1 2 16 64 256]

SmolLM2-135M's shapes in bf16: the four linear layers of a decoder layer and the tied LM head
(`linear_bf16` against `F.linear`; GB/s = weight bytes / time), then the elementwise kernels
against their eager sequences. Best of 3 repeats; ratio = eager time / kernel time (> 1: the
kernel is faster). "stream" runs all 30 layers' weights plus the LM head once per pass, so the
weights come from memory rather than cache, as in a real decode step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from impasto import kernels
from impasto.models.layers import RMSNorm, RotaryEmbedding

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
LINEARS = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN)}
LINEARS |= {"down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}


def best(fn: Callable[[], object], reps: int = 3, inner: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return min(times)


def row(name: str, t_eager: float, t_kernel: float, extra: str = "") -> None:
    times = f"{t_eager * 1e6:>10.0f} {t_kernel * 1e6:>10.0f}"
    print(f"{name:<28} {times} {t_eager / t_kernel:>7.2f}  {extra}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 16, 64, 256])
    args = p.parse_args()
    ops = kernels.load()
    if ops is None:
        raise SystemExit("the CPU kernels did not build (no C++ compiler?)")
    torch.manual_seed(0)
    bf = torch.bfloat16
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'case':<28} {'eager us':>10} {'kernel us':>10} {'ratio':>7}  kernel GB/s")
    for name, (out_f, in_f) in LINEARS.items():
        w = torch.randn(out_f, in_f).to(bf)
        for rows in args.rows:
            x = torch.randn(rows, in_f).to(bf)
            inner = 2 if rows * out_f > 1 << 22 else 10
            te = best(lambda x=x, w=w: F.linear(x, w), inner=inner)
            tk = best(lambda x=x, w=w: ops.linear_bf16(x, w), inner=inner)
            row(f"linear {name} x{rows}", te, tk, f"{w.numel() * 2 / tk / 1e9:.1f}")
    layer = [torch.randn(o, i).to(bf) for o, i in list(LINEARS.values())[:4]]
    # Distinct copies per layer: the pass reads ~270 MB, as a decode step does, not a cached few.
    weights = [w.clone() for _ in range(LAYERS) for w in layer] + [
        torch.randn(VOCAB, HIDDEN).to(bf)
    ]
    xs = {n: torch.randn(1, n).to(bf) for n in (HIDDEN, INTER)}
    total = sum(w.numel() * 2 for w in weights)
    te = best(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], inner=2)
    tk = best(lambda: [ops.linear_bf16(xs[w.shape[1]], w) for w in weights], inner=2)
    row("stream: a decode step's GEMVs", te, tk, f"{total / tk / 1e9:.1f}")
    for rows in (1, 512):
        x, r = torch.randn(rows, HIDDEN).to(bf), torch.randn(rows, HIDDEN).to(bf)
        norm = RMSNorm(HIDDEN, 1e-5).to(bf)
        te = best(lambda x=x, r=r, n=norm: n(x, r))
        norm.use_kernels(ops)
        tk = best(lambda x=x, r=r, n=norm: n(x, r))
        row(f"add + rms_norm x{rows}", te, tk)
        gu = torch.randn(rows, 2 * INTER).to(bf)
        te = best(lambda gu=gu: F.silu(gu[:, :INTER]) * gu[:, INTER:])
        tk = best(lambda gu=gu: ops.silu_and_mul(gu))
        row(f"silu * up x{rows}", te, tk)
        rope = RotaryEmbedding(64, {"rope_theta": 100000.0})
        qk = torch.randn(rows, 15, 64).to(bf)
        cs = rope.cos_sin(torch.arange(rows), bf)
        te = best(lambda qk=qk, cs=cs, rope=rope: rope(qk, cs))
        rope.use_kernels(ops)
        tk = best(lambda qk=qk, cs=cs, rope=rope: rope(qk, cs, inplace=True))
        row(f"rotary q+k x{rows}", te, tk)


if __name__ == "__main__":
    main()
