"""Linear layers written for tensor parallelism (Megatron-style; `parallel.py` holds the group).

Every parameter carries a `weight_loader(param, loaded, shard_id=None)` that takes the full
(unsharded) HF tensor and copies this rank's slice into place, so a checkpoint loader never
needs to know how a layer is sharded. Fused layers (QKV, gate/up) take one shard per call.
Parameters are created with `torch.empty` in torch's default dtype and device.

Sharding: column-parallel layers split output rows, row-parallel ones input columns (then one
all-reduce). Sizes N does not divide are zero-padded to ceil(size / N) per rank; attention
projections shard by heads instead (`tp_heads.HeadLayout`: padded query heads, KV heads
copied where they are fewer than N), so a head never straddles two ranks.

Packed GGUF weights (`quantized.py`): a `weight_loader` may receive a `QuantizedTensor` instead
of a dense tensor. When every shard of a layer arrives packed, `finish_loading` replaces the
`weight` parameter (never written, so never allocated) by a `PackedWeight` and the matmul by the
packed one; when a fused layer gets packed and dense shards, the packed ones are dequantized
into the parameter instead. Packed weights need one rank (tensor parallelism dequantizes).
"""

from __future__ import annotations

import torch
from torch import nn

from impasto.models.layers.device_hooks import LinearFn
from impasto.models.layers.packed import SwappableLinear, plain_linear
from impasto.models.layers.parallel import all_reduce, rank_shard, shard_size, tp_size
from impasto.models.layers.quantized import PackedWeight, QuantizedTensor, packed_linear_eager
from impasto.models.layers.tp_heads import HeadLayout


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def gather_heads(
    t: torch.Tensor, dim: int, heads: tuple[int | None, ...], head_dim: int
) -> torch.Tensor:
    """The slices `[h * head_dim, (h + 1) * head_dim)` of `t` along `dim`, in order; zeros for
    a None (padded) head."""
    parts = []
    for h in heads:
        if h is None:
            shape = list(t.shape)
            shape[dim] = head_dim
            parts.append(t.new_zeros(shape))
        else:
            parts.append(t.narrow(dim, h * head_dim, head_dim))
    return torch.cat(parts, dim=dim)


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


class LinearBase(SwappableLinear, nn.Module):
    """y = x W^T + b with W [out_local, in_local]. `tp_dim`: the dimension sharded (0/1/None).

    `linear` is F.linear until device preparation swaps it (packed.py: oneDNN or the kernels'
    bf16 GEMM)."""

    tp_dim: int | None = None
    accepts_packed = True  # its weight_loader takes QuantizedTensor shards
    shard_ids: tuple = (None,)  # shards a checkpoint must provide for each parameter

    def __init__(self, in_local: int, out_local: int, bias: bool) -> None:
        super().__init__()
        self.linear: LinearFn = plain_linear  # swapped by `pack_weights` / `use_kernels`
        self.weight = _param(out_local, in_local)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = _param(out_local) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self._packed_parts: dict[int, QuantizedTensor] = {}  # row offset -> packed shard

    def _load_packed(self, param: nn.Parameter, loaded: QuantizedTensor, offset: int) -> bool:
        """Keep a packed shard for `finish_loading`; False if it must be loaded dense."""
        if param is not self.weight or tp_size() > 1:
            return False
        self._packed_parts[offset] = loaded
        return True

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if isinstance(loaded, QuantizedTensor):
            if tp_size() == 1 and loaded.shape != tuple(param.shape):
                raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, "
                                 f"checkpoint {loaded.shape}")  # fmt: skip
            if self._load_packed(param, loaded, 0):
                return
            loaded = loaded.dequantize(param.dtype)  # sharded below
        dim = self.tp_dim if self.tp_dim is not None and self.tp_dim < loaded.dim() else None
        if dim is not None and tp_size() > 1:
            expected = shard_size(loaded.shape[dim])
            if param.shape[dim] != expected:
                raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint "
                                 f"{tuple(loaded.shape)} (sharded {tp_size()} ways)")  # fmt: skip
            loaded = rank_shard(loaded, dim, expected)
        _copy(param, loaded)

    def finish_loading(self) -> None:
        """Switch to the packed weight if every row arrived packed (see the module doc)."""
        parts, self._packed_parts = sorted(self._packed_parts.items()), {}
        if not parts:
            return
        covered = sum(p.shape[0] for _, p in parts)
        if covered == self.weight.shape[0]:  # offsets are distinct shards: rows all packed
            dtype = self.weight.dtype
            del self.weight
            self.weight = PackedWeight([p for _, p in parts], dtype)  # type: ignore[assignment]
            self.linear = packed_linear_eager
            return
        for offset, part in parts:  # mixed packed and dense shards: all dense
            self.weight.data.narrow(0, offset, part.shape[0]).copy_(
                part.dequantize(self.weight.dtype)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)


class ColumnParallelLinear(LinearBase):
    """Output features sharded across ranks; the output stays sharded (no communication)."""

    tp_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, shard_size(out_features), bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (e.g. gate/up).

    Shard i of the checkpoint lands at rows `sum(local_sizes[:i])` of the local weight, each
    shard split (and zero-padded) on its own.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        local_sizes: list[int] | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        self.local_sizes = local_sizes or [shard_size(s) for s in output_sizes]
        LinearBase.__init__(self, in_features, sum(self.local_sizes), bias)
        self.shard_ids = tuple(range(len(output_sizes)))

    def _offset(self, shard_id) -> tuple[int, int]:
        return sum(self.local_sizes[:shard_id]), self.local_sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError("a fused projection needs the shard id of each loaded tensor")
        offset, size = self._offset(shard_id)
        full = self.output_sizes[self._index(shard_id)]
        if loaded.shape[0] != full:
            raise ValueError(
                f"shape mismatch for shard {shard_id!r}: {tuple(loaded.shape)}, "
                f"expected {full} rows"
            )
        if isinstance(loaded, QuantizedTensor):
            if loaded.shape[1] != param.shape[1]:
                raise ValueError(f"shape mismatch for shard {shard_id!r}: {loaded.shape}")
            if self._load_packed(param, loaded, offset):
                return
            loaded = loaded.dequantize(param.dtype)
        if tp_size() > 1:
            loaded = self._rank_rows(loaded, shard_id, size)
        _copy(param.data.narrow(0, offset, size), loaded)

    def _index(self, shard_id) -> int:
        return int(shard_id)

    def _rank_rows(self, loaded: torch.Tensor, shard_id, size: int) -> torch.Tensor:
        """This rank's rows of one full checkpoint shard."""
        return rank_shard(loaded, 0, size)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection; heads are sharded, so shard ids are 'q', 'k', 'v'.

    `layout`: this rank's heads (`tp_heads.head_layout`); None: all of them (one rank)."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        layout: HeadLayout | None = None,
    ) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        if layout is None:
            layout = HeadLayout(tuple(range(num_heads)), tuple(range(num_kv_heads)))
        self.layout, self.head_dim = layout, head_dim
        local = [len(layout.q_heads) * head_dim] + [len(layout.kv_heads) * head_dim] * 2
        super().__init__(hidden, sizes, bias, local_sizes=local)
        self.shard_ids = ("q", "k", "v")

    def _index(self, shard_id) -> int:
        return "qkv".index(shard_id)

    def _offset(self, shard_id) -> tuple[int, int]:
        return super()._offset(self._index(shard_id))

    def _rank_rows(self, loaded: torch.Tensor, shard_id, size: int) -> torch.Tensor:
        heads = self.layout.q_heads if shard_id == "q" else self.layout.kv_heads
        return gather_heads(loaded, 0, heads, self.head_dim)


class RowParallelLinear(LinearBase):
    """Input features sharded; partial products are summed with an all-reduce."""

    tp_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(shard_size(in_features), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return self.linear(x, self.weight, self.bias)
        y = all_reduce(self.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class HeadRowParallelLinear(RowParallelLinear):
    """The attention output projection: input columns sharded by query head (this rank's
    `q_heads`, zero columns for padded heads), so it matches `QKVParallelLinear`'s layout."""

    def __init__(
        self,
        q_heads: tuple[int | None, ...],
        head_dim: int,
        out_features: int,
        bias: bool = False,
    ) -> None:
        self.q_heads, self.head_dim = q_heads, head_dim
        LinearBase.__init__(self, len(q_heads) * head_dim, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if tp_size() == 1 or param is not self.weight:
            return super().weight_loader(param, loaded, shard_id)
        if isinstance(loaded, QuantizedTensor):
            loaded = loaded.dequantize(param.dtype)
        _copy(param, gather_heads(loaded, 1, self.q_heads, self.head_dim))
