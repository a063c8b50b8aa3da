"""The typed hooks through which device preparation reaches the layers.

`impasto.kernels` builds the fused CPU ops and knows nothing of models; the worker's device
preparation (`impasto.worker.device_prep`) walks a model and calls these hooks. A layer opts in
by implementing them:

- `PacksWeights.pack_weights()`: reorder its weights once for a faster matmul (oneDNN, see
  `packed.py`); runs first;
- `UsesKernels.use_kernels(ops)`: switch its forward to the fused ops where they apply. Called
  children before parents, so a module spanning several layers (a decoder stack) sees its
  layers already switched. bf16 models only;
- `UsesPackedKernels.use_packed_kernels(ops)`: a layer holding packed GGUF weights computes
  with the kernels' packed matmul / lookup, for any activation dtype; runs before `use_kernels`;
- `Reproducible.make_reproducible()`: for a model with packed weights, every layer computes
  each row independently of the rest of its step (attention, the fused SiLU's row limit).

Invariant: with no hook called, every layer runs its eager PyTorch path; the hooks never
change what a layer computes beyond the kernels' documented rounding (`impasto.kernels`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

# y = x W^T + b: F.linear, the oneDNN packed matmul or the kernels' bf16 GEMM.
LinearFn = Callable[..., torch.Tensor]


class FusedOps(Protocol):
    """The op namespace of `impasto.kernels` (`torch.ops.impasto`), as the Python code calls it."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> torch.Tensor:
        """RMSNorm over the last dim, any leading shape (norm.py)."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) (norm.py)."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> [T, I]: silu(gate) * up (mlp.py)."""
        ...

    def linear_bf16(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The skinny bf16 GEMM (linear layers whose weights are not packed)."""
        ...

    def rotary_(self, x: torch.Tensor, table: torch.Tensor) -> None:
        """Rotate [T, H, D] in place with a `RotaryEmbedding.cos_sin` table (rotary.py)."""
        ...

    def softcap_(self, x: torch.Tensor, cap: float) -> None:
        """x = cap * tanh(x / cap) in place, float32 logits (DiffusionGemma's LM head)."""
        ...

    def paged_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        causal: torch.Tensor,
        scale: float,
        window: int,
        softcap: float,
    ) -> torch.Tensor:
        """Cache write + attention of a step of short queries (the torch attention backend)."""
        ...

    def decoder_layers(
        self,
        x: torch.Tensor,
        table: torch.Tensor,
        weights: Sequence[torch.Tensor | None],
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        causal: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        windows: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A Llama-family decoder stack in one call (`impasto.kernels.decoder_stack`)."""
        ...

    def quant_linear(
        self,
        x: torch.Tensor,
        blocks: Sequence[torch.Tensor],
        qtypes: Sequence[int],
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y = x W^T (+ b) on packed GGML row segments (impasto/kernels/quant_ops.cpp)."""
        ...

    def quant_linear_float(
        self,
        x: torch.Tensor,
        blocks: Sequence[torch.Tensor],
        qtypes: Sequence[int],
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The same product with float32 activations, weights dequantized exactly
        (impasto/kernels/quant_float.cpp)."""
        ...

    def quant_embedding(
        self, ids: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows `ids` of a packed table, dequantized to `dtype`."""
        ...

    def denoise_rows(
        self, logits: torch.Tensor, scale: torch.Tensor, u: torch.Tensor, grid: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The diffusion sampler's per-position pass (worker/diffusion/sampler.py)."""
        ...


@runtime_checkable
class UsesKernels(Protocol):
    def use_kernels(self, ops: FusedOps) -> bool:
        """Switch this module's forward to `ops` where they apply; True if it did."""
        ...


@runtime_checkable
class UsesPackedKernels(Protocol):
    def use_packed_kernels(self, ops: FusedOps) -> bool:
        """Compute with `ops` on this module's packed GGUF weight; True if it has one."""
        ...


@runtime_checkable
class Reproducible(Protocol):
    def make_reproducible(self) -> bool:
        """Compute so that no row's result depends on the rest of its step (the batch, the
        chunking of prompts, prefix-cache hits), bit for bit; True if this changed anything.
        Device preparation asks it of models with packed GGUF weights."""
        ...


@runtime_checkable
class FinishesLoading(Protocol):
    def finish_loading(self) -> None:
        """Called once every checkpoint tensor has been handed to the weight loaders."""
        ...


@runtime_checkable
class PacksWeights(Protocol):
    def pack_weights(self) -> bool:
        """Reorder this module's weights for a faster matmul if possible; True if it did.
        Idempotent."""
        ...
