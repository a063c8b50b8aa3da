"""Vocab-parallel token embedding and LM head (each rank holds a contiguous vocab slice).

A packed GGUF table (`quantized.py`) replaces the `weight` parameter by a `PackedWeight` at
load (one rank only; with more, it is dequantized): lookups dequantize the rows they read, and
an LM head tied to it computes on the packed table too (`finish_loading` re-ties the head to the
embedding's current weight, since the parameter it was tied to is gone).

`ParallelLMHead.limit_vocab(n)` narrows a head to the first n token ids (a draft model's
reduced vocabulary, `speculative_config["draft_vocab_size"]`): its own view of those rows,
packed or dense, never a copy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from impasto.models.layers.device_hooks import LinearFn
from impasto.models.layers.packed import SwappableLinear, plain_linear
from impasto.models.layers.parallel import all_gather_last_dim, all_reduce, divide, tp_rank, tp_size
from impasto.models.layers.quantized import (
    PackedWeight,
    QuantizedTensor,
    packed_embedding,
    packed_linear_eager,
)


class VocabParallelEmbedding(nn.Module):
    accepts_packed = True  # its weight_loader takes a QuantizedTensor table

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        # Pad the vocabulary so that it splits evenly; padded rows are never looked up.
        padded = -(-num_embeddings // tp_size()) * tp_size()
        self.local = divide(padded, tp_size())
        self.start = tp_rank() * self.local
        self.weight = nn.Parameter(torch.empty(self.local, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.quant_ops: Any = None  # the kernels' ops for a packed table (`use_packed_kernels`)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.num_embeddings or tuple(loaded.shape[1:]) != param.shape[1:]:
            raise ValueError(
                f"embedding shape {tuple(loaded.shape)} does not match "
                f"({self.num_embeddings}, {param.shape[1]})"
            )
        if isinstance(loaded, QuantizedTensor):
            if tp_size() == 1 and param is self.weight:
                del self.weight
                self.weight = PackedWeight([loaded], param.dtype)  # type: ignore[assignment]
                return
            loaded = loaded.dequantize(param.dtype)
        part = loaded[self.start : self.start + self.local]
        param.data[: part.shape[0]].copy_(part)
        param.data[part.shape[0] :].zero_()

    def use_packed_kernels(self, ops: Any) -> bool:
        if not isinstance(self.weight, PackedWeight):
            return False
        self.quant_ops = ops
        return True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if isinstance(self.weight, PackedWeight):
            return packed_embedding(input_ids, self.weight, self.quant_ops)
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.local)
        out = F.embedding(local.clamp(0, self.local - 1), self.weight)
        return all_reduce(out * inside[:, None].to(out.dtype))


class ParallelLMHead(SwappableLinear, VocabParallelEmbedding):
    """logits = h W^T; `tie_to` shares the embedding's weight (tied word embeddings)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tie_to: VocabParallelEmbedding | None = None
    ) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.linear: LinearFn = plain_linear  # swapped by `pack_weights` / `use_kernels`
        # Not a submodule (it is the model's embedding): a one-element list hides it from nn.
        self.tied_to: list[VocabParallelEmbedding] = [tie_to] if tie_to is not None else []
        if tie_to is not None:
            self.weight = tie_to.weight

    def finish_loading(self) -> None:
        if self.tied_to and self.weight is not self.tied_to[0].weight:
            del self.weight
            self.weight = self.tied_to[0].weight
        if isinstance(self.weight, PackedWeight) and self.linear is plain_linear:
            self.linear = packed_linear_eager

    def limit_vocab(self, n: int) -> None:
        """From now on compute the logits of token ids [0, n) only: [N, H] -> [N, n]. The
        head keeps its own view of the first n rows (untied: a tied embedding keeps the whole
        table for lookups). After loading and before device preparation, at one rank."""
        if tp_size() != 1:
            raise ValueError("limit_vocab needs tensor_parallel_size 1")
        if not 0 < n <= self.num_embeddings:
            raise ValueError(f"limit_vocab({n}) of a {self.num_embeddings}-token head")
        w = self.weight
        head = w.first_rows(n) if isinstance(w, PackedWeight) else w.detach()[:n]
        del self.weight
        self.tied_to = []
        self.weight = head if isinstance(head, PackedWeight) else nn.Parameter(head, False)
        self.num_embeddings = n

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        logits = all_gather_last_dim(self.linear(hidden, self.weight))
        return logits[:, : self.num_embeddings].float()
