"""Weight packing where oneDNN cannot pack bf16 (AVX2-only CPUs): skipped, never attempted."""

from __future__ import annotations

import torch

from impasto.models.layers import ReplicatedLinear
from impasto.models.layers.packed import plain_linear
from impasto.worker.device_prep import prepack_linear_weights


def test_unsupported_cpus_keep_plain_weights(monkeypatch):
    monkeypatch.setattr("impasto.models.layers.packed.cpu_supports_packing", lambda: False)
    layer = ReplicatedLinear(8, 8).to(torch.bfloat16)
    assert prepack_linear_weights(layer) == 0 and layer.linear is plain_linear
