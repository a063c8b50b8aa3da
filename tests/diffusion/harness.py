"""Run an impasto model on one request's tokens against a paged cache, without the runner."""

from __future__ import annotations

import torch

from impasto.attention.metadata import AttentionMetadata
from impasto.attention.registry import get_attention_backend
from impasto.worker.forward import model_forward


class OneRequest:
    """A single request with a contiguous block table and a zeroed paged KV cache."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 64) -> None:
        self.model, self.bs = model, block_size
        self.kv = [torch.zeros(2, num_blocks, block_size, h, d) for h, d in model.kv_cache_shapes()]
        self.blocks = torch.arange(1, num_blocks)[None]  # [1, num_blocks - 1]
        self.num_computed = 0

    def _meta(self, n: int, causal: bool, write: bool) -> AttentionMetadata:
        pos = torch.arange(self.num_computed, self.num_computed + n)
        slots = (pos // self.bs + 1) * self.bs + pos % self.bs if write else torch.full((n,), -1)
        seq = self.num_computed + n
        return AttentionMetadata(
            num_reqs=1,
            num_tokens=n,
            block_size=self.bs,
            query_lens=[n],
            seq_lens=[seq],
            causal=[causal],
            query_start_loc=torch.tensor([0, n]),
            seq_lens_t=torch.tensor([seq]),
            positions=pos,
            slot_mapping=slots,
            block_table=self.blocks,
        )

    @torch.inference_mode()
    def encode(self, ids: list[int]) -> torch.Tensor:
        """Causal pass that writes the cache; returns hidden states [n, H]."""
        meta = self._meta(len(ids), True, True)
        with model_forward(get_attention_backend(), meta, self.kv):
            h = self.model(torch.tensor(ids), meta.positions)
        self.num_computed += len(ids)
        return h

    @torch.inference_mode()
    def denoise(self, canvas: list[int], soft: torch.Tensor | None = None) -> torch.Tensor:
        """Bidirectional read-only pass over a canvas; returns logits [n, V]."""
        n = len(canvas)
        meta = self._meta(n, False, False)
        with model_forward(get_attention_backend(), meta, self.kv):
            h = self.model(torch.tensor(canvas), meta.positions, torch.arange(n), soft)
        return self.model.compute_logits(h)

    def cached_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, Hkv, D] keys and values of the committed tokens of one layer."""
        kv = self.kv[layer][:, 1:].reshape(2, -1, *self.kv[layer].shape[-2:])
        return kv[0, : self.num_computed], kv[1, : self.num_computed]
