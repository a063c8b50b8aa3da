"""The interfaces model classes implement, as the runners rely on them.

Every class in the registry (`registry.py`) implements one of two protocols: `CausalLM`
(autoregressive: Llama, Mistral, Qwen2, Qwen3, Gemma 3) or `DiffusionLM` (DiffusionGemma), which
extends it. `tests/models/test_interface.py` checks each registered class against its own.

Common contract:
  Model(config)                          parameters in torch's default dtype/device; cast with
                                         `.to(dtype)` (load_hf_model builds in `dtype` directly)
  forward(input_ids [T], positions [T])  -> hidden [T, hidden]; runs inside a forward context
                                         (`impasto.worker.forward.model_forward`): attention
                                         layers take the metadata, KV caches, backend and plan
                                         from it, so a model never names a backend
  compute_logits(hidden [N, hidden])     -> logits [N, vocab] float32
  load_weights(iterable of (HF name, tensor)), strict
  kv_cache_shapes()                      -> [(num_kv_heads, head_dim)] per layer (layer_idx order)

Differences of a diffusion model (`DiffusionLM`):
- `forward` also takes the self-conditioning rows of the batch (`sc_rows`, the canvas tokens
  run in decoder mode) and their soft embeddings (`sc_soft`); without them it is a plain causal
  pass (prompt prefill, canvas commit), so a `DiffusionLM` is usable wherever a `CausalLM` is;
- `soft_embeddings(probs)` makes the next step's `sc_soft`; `compute_logits` may write into a
  caller's workspace (`out`); `hidden_size` sizes the zero self-conditioning input;
- `image_token_id`: a multimodal checkpoint's image placeholder, which admission refuses;
- `use_kernels(ops | None)`: the diffusion runner points its soft-capping at the CPU kernels
  for every dtype (AR models get kernels only through device preparation, bf16 CPU).
`is_diffusion` tells the two apart: False for every `CausalLM` that is not a `DiffusionLM`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from impasto.models.layers.device_hooks import FusedOps


@runtime_checkable
class CausalLM(Protocol):
    is_diffusion: bool
    vocab_size: int

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """nn.Module's call: runs `forward`."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
    ) -> torch.Tensor:  # [T, hidden]
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def kv_cache_shapes(self) -> list[tuple[int, int]]: ...


@runtime_checkable
class DiffusionLM(CausalLM, Protocol):
    hidden_size: int
    image_token_id: int | None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        sc_rows: torch.Tensor | None = None,
        sc_soft: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        sc_rows: torch.Tensor | None = None,  # [N] rows of canvas (decoder-mode) tokens
        sc_soft: torch.Tensor | None = None,  # [N, H] their soft embeddings (zeros: first step)
    ) -> torch.Tensor:  # [T, H]
        ...

    def compute_logits(
        self,
        hidden: torch.Tensor,  # [N, H]
        out: torch.Tensor | None = None,  # [N, V] float32 workspace to write into
    ) -> torch.Tensor:  # [N, V] float32
        ...

    def soft_embeddings(self, probs: torch.Tensor) -> torch.Tensor:  # [N, V] -> [N, H]
        ...

    def use_kernels(self, ops: FusedOps | None) -> bool: ...
