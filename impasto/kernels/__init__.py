"""Fused CPU kernels, compiled on first use with the machine's C++ compiler into one library.

What they replace, per decoder layer of a bf16 model on CPU: the linear layers' bf16 matmul
where oneDNN cannot pack bf16 weights (an AVX2 GEMM that converts weights in registers,
`cpu_linear.cpp`), residual add + RMSNorm (one call instead of two), SiLU * up (one instead of
two plus slicing; decode-sized inputs only, see `mlp.py`), rotary on the fused qkv projection
in place (one instead of five; these three in `cpu_ops.cpp`), and, for steps where every
request is a short, cache-writing query (decodes, speculative verification), the KV-cache write
and paged attention (one instead of about twelve, `cpu_attention.cpp`). Eager PyTorch pays more
for dispatching these small kernels than for their arithmetic at batch 1 (see
docs/benchmarks.md). On those steps the decoder layers of a Llama-family model run as one call
that chains the same kernels in C++ (`decoder_layers` in `cpu_ops.cpp`, see `decoder_stack.py`),
so no Python runs between them. `cpu_ops.h` and `vec_math.h` hold what these files share.

This package is a leaf: it builds and exposes the ops (`load()`, `ops()`, `enabled()`,
`wanted()`) and imports nothing else from impasto. Models opt in through the typed hooks of
`impasto.models.layers.device_hooks`; `impasto.worker.device_prep` walks a model and calls them.

`quant_ops.cpp`: matmuls on packed GGML blocks (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K), with 8-bit activation blocks and integer dot products (VNNI where the CPU has it,
AVX2 otherwise; the integer sums are exact, so every instruction set gives the same bits, and a
row's result does not depend on the other rows of its batch). It drives the kernels of GGML's
row layout (`quant_rows.cpp`) and of rows interleaved by 8 (`quant_x8.cpp`, repacked by
`quant_x8_repack.cpp`) for bfloat16 models; float32 models (op `quant_linear_float`) and builds
without AVX2 take the float kernel (`quant_float.cpp`: each weight row dequantized exactly by
`quant_dequant.cpp`, which also serves embedding lookups, and met by unrounded float32
activations: what the dequantized model computes, to summation order). `IMPASTO_CPU_ISA=avx2`
builds the AVX2 paths on a CPU that has more (tests compare the two).

Policy: the layer kernels serve 16-bit (bfloat16) models only. float32 keeps the eager
reference path, which the token-exact tests against transformers use; the kernels compute in
float32 and round once, so they are accurate but not bit-identical to eager bf16.
`diffusion_ops.cpp` is the exception: the diffusion sampler's per-position pass (grid snap,
softmax, entropy, inverse-CDF draw, argmax over [positions, vocab], in place) and soft-capping
work on float32 logits whatever the model dtype, so the diffusion runner uses them for every
dtype on CPU. Its grid-snapped logits and argmax equal the eager path's bit for bit; sums run
in double, so probabilities and entropies agree to float rounding (tests/kernels).

`token_mask_ops.cpp`: structured outputs' grammar bitmasks applied to float32 / bfloat16 logits
in place, whatever the model dtype (the eager fallback unpacks the bits with numpy).

`load()` builds the library once per source, flags, torch version and CPU kind (about 20 s,
cached under the user cache directory) and returns the op namespace, or None when disabled
(`IMPASTO_CPU_KERNELS=0`) or when no compiler is available (the eager path is used then, with a
warning). `ops()` returns what `load()` produced without building anything.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
# one library, one op namespace
SOURCES = (
    _DIR / "cpu_ops.cpp",
    _DIR / "cpu_attention.cpp",
    _DIR / "cpu_linear.cpp",
    _DIR / "diffusion_ops.cpp",
    _DIR / "quant_ops.cpp",
    _DIR / "quant_rows.cpp",
    _DIR / "quant_dequant.cpp",
    _DIR / "quant_float.cpp",
    _DIR / "quant_x8.cpp",
    _DIR / "quant_x8_repack.cpp",
    _DIR / "token_mask_ops.cpp",
)
HEADERS = (
    _DIR / "vec_math.h",
    _DIR / "cpu_ops.h",
    _DIR / "quant_ops.h",
    _DIR / "quant_blocks.h",
    _DIR / "quant_rows.h",
    _DIR / "quant_x8.h",
    _DIR / "quant_x8_layout.h",
    _DIR / "quant_x8_avx512.h",
)
_OPS: Any = None
_FLAGS_VERSION = b"3"  # bump when the compiler flags change
_TRIED = False


def enabled() -> bool:
    return os.environ.get("IMPASTO_CPU_KERNELS", "1") != "0"


def _cpu_features() -> bytes:
    """The CPU's feature flags: the library is built with -march=native, so a cache shared by
    machines of different kinds (a network home directory) must not mix their builds."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return (flags or platform.machine()).encode()


def isa_flags() -> list[str]:
    """Compiler flags that narrow -march=native: `IMPASTO_CPU_ISA=avx2` builds the AVX2 code
    paths on a CPU that has AVX-512 / VNNI (tests check both give the same results)."""
    isa = os.environ.get("IMPASTO_CPU_ISA", "native")
    if isa == "native":
        return []
    if isa == "avx2":
        return ["-mno-avx512f", "-mno-avxvnni"]  # no AVX-512 subset without avx512f
    raise ValueError(f"IMPASTO_CPU_ISA must be 'native' or 'avx2', not {isa!r}")


def _build_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    sources = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    flags = " ".join(isa_flags()).encode()
    key = sources + _FLAGS_VERSION + flags + torch.__version__.encode() + _cpu_features()
    digest = hashlib.sha256(key).hexdigest()[:16]
    path = base / "impasto" / "kernels" / digest
    path.mkdir(parents=True, exist_ok=True)
    return path


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` package installs it next to this interpreter,
    which is not on PATH when a virtualenv's python is run without activating it."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # the PyPI package (a project dependency)
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load() -> Any:
    """The `torch.ops.impasto` namespace, building the library if needed; None if unavailable."""
    global _OPS, _TRIED
    if _TRIED or not enabled():
        return _OPS if enabled() else None
    _TRIED = True
    try:
        from torch.utils.cpp_extension import load as load_extension

        _put_ninja_on_path()

        build = _build_dir()
        if not any(build.glob("*.so")):
            logger.info("compiling impasto's CPU kernels once (about 20 s) into %s", build)
        load_extension(
            "impasto_cpu_ops",
            [str(p) for p in SOURCES],
            # OpenMP: at::parallel_for is a header template; without it the kernels run on
            # one thread. The runtime is torch's own (same soname, already loaded).
            # -fno-trapping-math / -fno-math-errno: lets GCC vectorize clamps and sqrt (the
            # kernels never read FP exception flags or errno).
            extra_cflags=[
                "-O3",
                "-march=native",
                "-ffp-contract=fast",
                "-fno-trapping-math",
                "-fno-math-errno",
                "-fopenmp",
                *isa_flags(),
            ],  # fmt: skip
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            build_directory=str(build),
        )
        _OPS = torch.ops.impasto
    except Exception as exc:  # no compiler, no ninja, ...: the eager path still works
        logger.warning("impasto CPU kernels unavailable, using eager PyTorch: %s", exc)
        _OPS = None
    return _OPS


def ops() -> Any:
    """The loaded op namespace, or None (never builds: hot paths call this)."""
    return _OPS if enabled() else None


def wanted(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of this dtype on this device should use the kernels (16-bit CPU)."""
    return enabled() and device.type == "cpu" and dtype == torch.bfloat16
