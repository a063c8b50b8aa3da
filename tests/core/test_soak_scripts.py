"""The soak scripts (`benchmarks/soak_ar.py`, `benchmarks/soak_diffusion.py`) run their
`--quick` smoke mode through `main()` and pass, so that they cannot rot between full runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.fixtures import one_torch_thread

__all__ = ["one_torch_thread"]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_soak_script_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["soak_ar", "soak_diffusion"])
def test_quick_soak_passes(name, capsys):
    code = load_script(name).main(["--quick", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "result" in out and "PASS" in out
