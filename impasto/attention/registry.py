"""Attention backends keyed by name, imported lazily (like `models/registry.py`).

A backend is chosen per runner, never by a model: the runner builds each step's plan with it
and hands both to the layers through `forward_context`. Adding a backend (e.g. a GPU one) is
registering its class here or through `register_attention_backend`; no model file changes.

Invariant: one instance per name and process (`get_attention_backend`), constructed with no
arguments. Instances hold configuration only, never per-step state (that is the plan's).
"""

from __future__ import annotations

import importlib

from impasto.attention.backend import AttentionBackend

DEFAULT_ATTENTION_BACKEND = "torch"

# name -> (module, under impasto.attention unless dotted; class name)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("torch_backend", "TorchAttentionBackend"),
}
_INSTANCES: dict[str, AttentionBackend] = {}


def supported_attention_backends() -> list[str]:
    return sorted(_BACKENDS)


def register_attention_backend(name: str, module: str, class_name: str) -> None:
    """Add (or replace) a backend; `module` is a full import path or a name under
    impasto.attention."""
    _BACKENDS[name] = (module, class_name)
    _INSTANCES.pop(name, None)


def get_attention_backend(name: str = DEFAULT_ATTENTION_BACKEND) -> AttentionBackend:
    """The process-wide instance of a registered backend."""
    if name not in _INSTANCES:
        if name not in _BACKENDS:
            raise ValueError(
                f"unknown attention backend {name!r}; supported: {supported_attention_backends()}"
            )
        module, class_name = _BACKENDS[name]
        path = module if "." in module else f"impasto.attention.{module}"
        cls = getattr(importlib.import_module(path), class_name)
        _INSTANCES[name] = cls()
    return _INSTANCES[name]
