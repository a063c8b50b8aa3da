"""How to compute on packed GGML weights: 8-bit activations + integer dot products (what
impasto's kernels do) against dequantizing in registers + float32 FMA (the alternative), and
the memory bandwidth each reaches. Same run, interleaved repetitions, medians.

    python benchmarks/quant_kernels.py     # Q8_0 and Q4_K, 8960 x 1536 (Qwen2.5-1.5B's MLP)
    python benchmarks/quant_kernels.py --rows 4096 --cols 4096 --batches 1 4 16 64 256

The float-FMA kernels (quant_float_fma.cpp) are compiled here and are not part of impasto:
each weight block is widened to float32 in registers and met by the activations in float32
(no activation rounding). They share the integer kernels' structure: the same row
split across threads, the same 4-row activation passes, the same 64-row tiles.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from impasto import kernels


def float_fma_ops():
    from torch.utils.cpp_extension import load

    return load(
        "impasto_bench_float_fma",
        [str(Path(__file__).with_name("quant_float_fma.cpp"))],
        extra_cflags=["-O3", "-march=native", "-fopenmp", *kernels.isa_flags()],
        extra_ldflags=["-fopenmp"],
    )


def random_blocks(qtype: Q, rows: int, cols: int) -> torch.Tensor:
    rng = np.random.default_rng(0)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    raw[..., 0:4] = (rng.random((rows, cols // elems, 2)) * 0.01).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def memory_bandwidth_gbs(repeats: int = 5) -> float:
    """A read of 1 GiB (a sum over a buffer far larger than the caches), all threads."""
    buf = torch.ones(1 << 28, dtype=torch.float32)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(repeats))
    return buf.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8960)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    ops, fma = kernels.load(), float_fma_ops()
    assert ops is not None, "impasto's kernels are needed"
    bw = memory_bandwidth_gbs()
    print(f"threads {torch.get_num_threads()}, dot products: {ops.quant_isa()}, "
          f"memory read bandwidth {bw:.1f} GB/s")  # fmt: skip
    print(f"{'type':5} {'rows':>5} {'int8 ms':>9} {'fp32 ms':>9} {'fp32/int8':>9} "
          f"{'int8 GB/s':>9} {'int8 GFLOP/s':>12} {'max rel diff':>12}")  # fmt: skip
    for qtype, fn in ((Q.Q8_0, fma.fma_q8_0), (Q.Q4_K, fma.fma_q4_k)):
        w = random_blocks(qtype, args.rows, args.cols)
        for t in args.batches:
            x = torch.randn(t, args.cols)
            a = ops.quant_linear(x, [w], [int(qtype)])
            b = fn(x, w)
            diff = ((a - b).abs().max() / b.abs().max()).item()
            ti, tf = [], []
            int8_call = lambda x=x, w=w, q=int(qtype): ops.quant_linear(x, [w], [q])  # noqa: E731
            fp32_call = lambda x=x, w=w, fn=fn: fn(x, w)  # noqa: E731
            for _ in range(args.repeats):  # interleaved: both see the same machine state
                ti.append(_timed(int8_call))
                tf.append(_timed(fp32_call))
            mi, mf = statistics.median(ti), statistics.median(tf)
            flops = 2 * args.rows * args.cols * t
            print(f"{qtype.name:5} {t:5d} {mi * 1e3:9.3f} {mf * 1e3:9.3f} {mf / mi:9.2f} "
                  f"{w.numel() / mi / 1e9:9.1f} {flops / mi / 1e9:12.1f} {diff:12.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
