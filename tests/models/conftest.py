"""Tiny models run on one torch thread (see `tests.fixtures`)."""

from __future__ import annotations

from tests.fixtures import one_torch_thread

__all__ = ["one_torch_thread"]
