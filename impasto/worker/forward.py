"""Open a model forward: build the step's attention plan once, then scope it for the layers.

Every place that runs a model (the model runner, the diffusion runner, the draft proposer,
test harnesses) opens its forward through `model_forward`, so the plan is built exactly once
per forward and always from the metadata as the model will see it: edit the metadata first
(e.g. the diffusion runner's read-only, bidirectional canvas rows), then open the forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from impasto.attention.backend import AttentionBackend
from impasto.attention.metadata import AttentionMetadata, forward_context


@contextmanager
def model_forward(
    backend: AttentionBackend[Any], metadata: AttentionMetadata, kv_caches: list[torch.Tensor]
) -> Iterator[None]:
    """`with model_forward(backend, meta, caches): hidden = model(...)`."""
    with forward_context(metadata, kv_caches, backend, backend.build_plan(metadata)):
        yield
