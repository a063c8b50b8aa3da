"""Strict loading of HF-named checkpoint tensors into a model built from shared layers.

A checkpoint tensor may be a packed GGUF `QuantizedTensor`: it goes to layers that keep packed
weights (`accepts_packed`: linear layers, embeddings, LM heads) as it is, and is dequantized to
the parameter's dtype for any other. Once all tensors are in, every module with a
`finish_loading` hook is called (packed layers swap their weights then).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from impasto.models.layers.device_hooks import FinishesLoading
from impasto.models.layers.quantized import QuantizedTensor

# (fused parameter name part, HF name part, shard id): HF's q/k/v and gate/up tensors load
# into the fused projections as shards.
STACKED_PARAMS: list[tuple[str, str, object]] = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: {tuple(param.shape)} vs {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def load_weights_strict(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    tied_lm_head: bool,
    stacked: list[tuple[str, str, object]] = STACKED_PARAMS,
) -> None:
    """Load every parameter exactly from `weights`; raise ValueError on missing/unexpected.

    Tolerated extras: `*.rotary_emb.inv_freq`, and `lm_head.weight` when the head is tied to
    the embedding (checkpoints often store the duplicate).
    """
    params = dict(model.named_parameters())  # tied weights appear once
    seen: dict[str, set] = {}
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq") or (tied_lm_head and name == "lm_head.weight"):
            continue
        target, shard = name, None
        for fused, part, shard_id in stacked:
            if f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{fused}."), shard_id
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        if isinstance(tensor, QuantizedTensor):
            owner = model.get_submodule(target.rpartition(".")[0])
            if not getattr(owner, "accepts_packed", False):
                tensor = tensor.dequantize(param.dtype)
        try:
            loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"cannot load {name}: {e}") from e
        seen.setdefault(target, set()).add(shard)

    missing: list[str] = []
    for pname in params:
        owner = model.get_submodule(pname.rpartition(".")[0])
        for shard in getattr(owner, "shard_ids", (None,)):
            if shard in seen.get(pname, ()):
                continue
            hf = pname
            for fused, part, shard_id in stacked:
                if shard_id == shard and f".{fused}." in pname:
                    hf = pname.replace(f".{fused}.", f".{part}.")
            missing.append(hf)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {type(model).__name__}: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    for module in list(model.modules()):  # a list: packed layers add submodules as they finish
        if isinstance(module, FinishesLoading):
            module.finish_loading()
