"""DiffusionGemma (HF `diffusion_gemma`, `DiffusionGemmaForBlockDiffusion`), text only.

One Gemma-4-style backbone run in two modes with shared weights, chosen per request by the
runner through the attention metadata (never by the model):

- encoder: causal attention that writes the paged KV cache (prompt prefill, canvas commit);
- decoder: bidirectional attention over the canvas that reads the cache and writes nothing
  (`slot_mapping == -1`); its input embeddings first go through the self-conditioning block,
  fed with `softmax(previous processed logits) @ E * sqrt(H)` (zeros on a canvas' first step).

Layers: q/k RMSNorm, an unscaled v norm, attention scale 1; sliding layers have their own head
dim and a default rotary; full layers a larger head dim, no `v_proj` (V = raw K) and
"proportional" partial rotary. Each layer sums a dense gated-GELU MLP and, when configured,
a routed mixture of experts (dense checkpoints: `num_experts` unset).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from impasto.models.layers import Attention, RMSNorm, RotaryEmbedding
from impasto.models.layers.device_hooks import FusedOps
from impasto.models.layers.moe import GemmaExperts, GemmaRouter
from impasto.models.weights import load_weights_strict

_PREFIXES = ("model.decoder.", "model.encoder.language_model.")  # tied copies of one backbone
_IGNORED = ("model.encoder.vision_tower.", "model.encoder.embed_vision.", "lm_head.")


class Norm(RMSNorm):
    """Gemma-4 RMSNorm: x * w in float32 (the weight is stored as is, not zero-centred)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__(dim, eps)
        if not with_scale:
            del self.weight
            self.weight = None  # type: ignore[assignment]

    def use_kernels(self, ops: FusedOps) -> bool:
        return False  # its own formula (optional weight), not the fused kernel's

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), w, self.eps).to(x.dtype)


def _linear(i: int, o: int) -> nn.Linear:
    layer = nn.Linear(i, o, bias=False)
    layer.weight.requires_grad_(False)
    return layer


def layer_shape(tc: Any, i: int) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of layer i, from the per-layer overrides of full layers."""
    layer = tc.per_layer_config[i]
    return int(layer.num_key_value_heads), int(layer.head_dim)


def make_rotary(tc: Any, layer_type: str, head_dim: int) -> RotaryEmbedding:
    params = dict(tc.rope_parameters[layer_type])
    kind = params.get("rope_type", "default")
    rot = RotaryEmbedding(head_dim, {"rope_theta": params["rope_theta"], "rope_type": "default"})
    if kind == "proportional":
        # head_dim/2 frequencies, the first `angles` non-zero (exponent over the full head_dim),
        # the rest 0 (identity): rotate-half over the whole head.
        angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv = 1.0 / params["rope_theta"] ** (torch.arange(0, 2 * angles, 2).float() / head_dim)
        rot.inv_freq = torch.cat([inv, torch.zeros(head_dim // 2 - angles)]) / params.get(
            "factor", 1.0
        )
        rot.rot_dim = head_dim
    elif kind != "default":
        raise NotImplementedError(f"DiffusionGemma rope_type {kind!r} is not supported")
    return rot


class DGAttention(nn.Module):
    def __init__(self, tc: Any, i: int) -> None:
        super().__init__()
        self.sliding = tc.layer_types[i] == "sliding_attention"
        self.num_kv_heads, self.head_dim = layer_shape(tc, i)
        hq, hkv, d, h = tc.num_attention_heads, self.num_kv_heads, self.head_dim, tc.hidden_size
        self.q_proj, self.k_proj = _linear(h, hq * d), _linear(h, hkv * d)
        self.v_proj = _linear(h, hkv * d) if self.sliding else None  # full layers: V = K
        self.o_proj = _linear(hq * d, h)
        self.q_norm, self.k_norm = Norm(d, tc.rms_norm_eps), Norm(d, tc.rms_norm_eps)
        self.v_norm = Norm(d, tc.rms_norm_eps, with_scale=False)
        window = tc.sliding_window if self.sliding else None
        self.attn = Attention(hq, hkv, d, i, scale=1.0, sliding_window=window)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, rot: RotaryEmbedding):
        t, d = x.shape[0], self.head_dim
        q = rot(self.q_norm(self.q_proj(x).view(t, -1, d)), cos_sin)  # [T, Hq, D]
        k_raw = self.k_proj(x).view(t, -1, d)  # [T, Hkv, D]
        v = self.v_norm(k_raw if self.v_proj is None else self.v_proj(x).view(t, -1, d))
        k = rot(self.k_norm(k_raw), cos_sin)
        return self.o_proj(self.attn(q, k, v))


class DGLayer(nn.Module):
    def __init__(self, tc: Any, i: int) -> None:
        super().__init__()
        h, eps = tc.hidden_size, tc.rms_norm_eps
        self.self_attn = DGAttention(tc, i)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": _linear(h, tc.intermediate_size),
                "up_proj": _linear(h, tc.intermediate_size),
                "down_proj": _linear(tc.intermediate_size, h),
            }
        )
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", Norm(h, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.moe = bool(getattr(tc, "num_experts", None))
        if self.moe:
            self.router = GemmaRouter(h, tc.num_experts, tc.top_k_experts, eps)
            self.experts = GemmaExperts(h, tc.moe_intermediate_size, tc.num_experts)
            self.post_feedforward_layernorm_1 = Norm(h, eps)
            self.post_feedforward_layernorm_2 = Norm(h, eps)
            self.pre_feedforward_layernorm_2 = Norm(h, eps)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, rot: RotaryEmbedding):
        a = self.self_attn(self.input_layernorm(x), cos_sin, rot)
        x = x + self.post_attention_layernorm(a)
        m = self.mlp
        y = self.pre_feedforward_layernorm(x)
        y = m["down_proj"](F.gelu(m["gate_proj"](y), approximate="tanh") * m["up_proj"](y))
        if self.moe:
            weights, ids = self.router(x)
            e = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(e)
        return (x + self.post_feedforward_layernorm(y)) * self.layer_scalar


class SelfConditioning(nn.Module):
    """post_norm(embeds + MLP(pre_norm(soft embeddings))), post_norm without a scale."""

    def __init__(self, tc: Any) -> None:
        super().__init__()
        h, i = tc.hidden_size, tc.intermediate_size
        self.pre_norm = Norm(h, tc.rms_norm_eps)
        self.post_norm = Norm(h, tc.rms_norm_eps, with_scale=False)
        self.gate_proj, self.up_proj, self.down_proj = _linear(h, i), _linear(h, i), _linear(i, h)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        n = self.pre_norm(soft)
        sc = self.down_proj(F.gelu(self.gate_proj(n), approximate="tanh") * self.up_proj(n))
        return self.post_norm(embeds + sc)


class DiffusionGemmaForBlockDiffusion(nn.Module):
    """Implements `impasto.models.interface.DiffusionLM` (self-conditioning rows: see forward)."""

    is_diffusion = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "text_config", None) is None:
            raise ValueError("a DiffusionGemma config needs a text_config")
        self.config, tc = config, config.text_config
        if getattr(tc, "use_bidirectional_attention", None) == "all":
            raise NotImplementedError(
                "DiffusionGemma with a bidirectional encoder is not supported"
            )
        if getattr(tc, "attention_bias", False):
            raise NotImplementedError("DiffusionGemma attention biases are not supported")
        self.text_config = tc
        self.canvas_length = int(getattr(config, "canvas_length", None) or 256)
        self.image_token_id = getattr(config, "image_token_id", None)
        self.vocab_size, self.hidden_size = tc.vocab_size, tc.hidden_size
        self.embed_tokens = nn.Embedding(tc.vocab_size, tc.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DGLayer(tc, i) for i in range(tc.num_hidden_layers))
        self.norm = Norm(tc.hidden_size, tc.rms_norm_eps)
        self.self_conditioning = SelfConditioning(tc)
        self.layer_types = list(tc.layer_types)
        self.rotary = nn.ModuleDict(
            {
                t: make_rotary(tc, t, layer_shape(tc, self.layer_types.index(t))[1])
                for t in sorted(set(self.layer_types))
            }
        )
        self.softcap = getattr(tc, "final_logit_softcapping", None)
        self.fused_ops: FusedOps | None = None  # `use_kernels`: soft-capping in place

    def use_kernels(self, ops: FusedOps | None) -> bool:
        """The soft-capping kernel (float32 logits, so every dtype on CPU; the diffusion runner
        calls it); None: back to eager soft-capping."""
        self.fused_ops = ops
        return ops is not None

    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        return F.embedding(input_ids, w) * torch.tensor(self.embed_scale, dtype=w.dtype)

    def soft_embeddings(self, probs: torch.Tensor) -> torch.Tensor:
        """Self-conditioning signal: softmax(processed logits) [N, V] -> [N, H] (model dtype)."""
        w = self.embed_tokens.weight
        return (probs.to(w.dtype) @ w) * torch.tensor(self.embed_scale, dtype=w.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        sc_rows: torch.Tensor | None = None,  # [N] rows of canvas (decoder-mode) tokens
        sc_soft: torch.Tensor | None = None,  # [N, H] their soft embeddings (zeros: first step)
    ) -> torch.Tensor:  # [T, H]
        x = self.embed(input_ids)
        if sc_rows is not None and sc_rows.numel():
            soft = sc_soft if sc_soft is not None else torch.zeros_like(x[sc_rows])
            x = x.index_copy(0, sc_rows, self.self_conditioning(x[sc_rows], soft.to(x.dtype)))
        cos_sin = {t: r.cos_sin(positions, x.dtype) for t, r in self.rotary.items()}
        for layer, kind in zip(self.layers, self.layer_types, strict=True):
            x = layer(x, cos_sin[kind], self.rotary[kind])
        return self.norm(x)

    def compute_logits(
        self,
        hidden: torch.Tensor,  # [N, H]
        out: torch.Tensor | None = None,  # [N, V] float32 to write into (a reused workspace)
    ) -> torch.Tensor:  # [N, V] float32
        w = self.embed_tokens.weight
        if out is None:
            logits = F.linear(hidden, w).float()
        elif w.dtype == hidden.dtype == torch.float32:
            logits = torch.mm(hidden, w.t(), out=out)
        else:
            logits = out.copy_(F.linear(hidden, w))
        if self.softcap:  # in place: [N, V] is large (N = canvas rows), fresh buffers cost
            if self.fused_ops is not None and logits.device.type == "cpu":
                self.fused_ops.softcap_(logits, float(self.softcap))
            else:
                logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_IGNORED):
                    continue  # text only: the vision tower is never loaded; the head is tied
                for prefix in _PREFIXES:
                    if name.startswith(prefix):
                        name = name[len(prefix) :]
                        break
                yield name, tensor

        load_weights_strict(self, renamed(), tied_lm_head=True, stacked=[])

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        return [(la.self_attn.num_kv_heads, la.self_attn.head_dim) for la in self.layers]
