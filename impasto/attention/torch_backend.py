"""Plain-PyTorch reference attention backend (CPU and any torch device).

Per layer: write the step's k/v into the paged cache, then
- short-query requests (see `torch_plan`), per chunk of requests, with the queries grouped per
  KV head (`[n, Hkv, G*Q, D]`, so GQA needs no K/V repeat) and a workspace reused by all layers:
  fp32: gather their K/V blocks, one SDPA; 16-bit: gather keys head-major, scores by matmul,
  fp32 softmax, P @ V by `embedding_bag` over the cache's value rows (values never copied);
- other requests: one SDPA each over the cached prefix and the new keys.

Steps where every request is a short, cache-writing query go to the fused CPU kernel instead
(one call per layer for the cache write and attention) when the plan says it takes them. A
layer asking for reproducible attention (packed GGUF models) gets the fused kernel for every
step whose keys are all written, whatever the query lengths: its rows do not depend on the
batch, on chunking or on prefix caching (see the kernel), which the SDPA paths do not promise
(their blocking follows the padded batch), and 8-bit activations downstream would turn such
last-bit differences into different tokens.

Invariant: the cache is written *before* it is read, so for requests whose slots are all
written the gathered context already holds this step's keys (bit-identical to `k`/`v` when the
cache has the model dtype). Requests with any slot -1 never read their new keys from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from impasto import kernels
from impasto.attention.backend import AttentionBackend
from impasto.attention.metadata import AttentionMetadata
from impasto.attention.torch_plan import SHORT_QUERY_MAX, Group, Long, Plan, build_plan

__all__ = ["SHORT_QUERY_MAX", "TorchAttentionBackend", "sdpa"]


def sdpa(
    q: torch.Tensor,  # [N, Hq, R, D]
    k: torch.Tensor,  # [N, Hkv, L, D]
    v: torch.Tensor,  # [N, Hkv, L, D]
    mask: torch.Tensor | None,  # additive, broadcastable to [N, Hq, R, L]
    scale: float,
    softcap: float | None,
    is_causal: bool = False,
) -> torch.Tensor:  # [N, Hq, R, D]
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    # SDPA has no soft-capping: explicit fp32 path (Gemma-2 style models only).
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if is_causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu_(1), float("-inf"))
    if mask is not None:
        s = s + mask
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


class TorchAttentionBackend(AttentionBackend[Plan]):
    name = "torch"

    def __init__(self, short_path: str = "auto") -> None:
        """`short_path`: "sdpa", "bag" or "auto" (sdpa for fp32 caches; for bf16 caches the
        fused kernel when `impasto.kernels` is loaded, else bag)."""
        if short_path not in ("auto", "sdpa", "bag"):
            raise ValueError(f"short_path must be 'auto', 'sdpa' or 'bag', not {short_path!r}")
        self.short_path = short_path

    def build_plan(self, metadata: AttentionMetadata) -> Plan:
        plan = build_plan(metadata)
        if plan.causal_t is not None and self.short_path == "auto":
            plan.fused_ops = kernels.ops()  # None when the kernels are not loaded
        return plan

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: Plan,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        reproducible: bool = False,
    ) -> torch.Tensor:
        if reproducible:
            causal = plan.fused_reproducible(kv_cache, q.dtype)
        else:
            causal = plan.fused_short_queries(kv_cache, q.dtype)
        if causal is not None:  # one fused call: cache write + attention for every request
            return plan.fused_ops.paged_attention(
                q, k, v, kv_cache, metadata.slot_mapping, metadata.block_table,
                metadata.query_start_loc, metadata.seq_lens_t, causal,
                scale, sliding_window or 0, logit_softcap or 0.0,
            )  # fmt: skip
        _, num_blocks, bs, hkv, d = kv_cache.shape
        if plan.write_slots is not None:  # write first: short and written requests read it back
            flat = kv_cache.view(2, num_blocks * bs, hkv, d)
            kw, vw = (k, v) if plan.write_rows is None else (k[plan.write_rows], v[plan.write_rows])
            if kw.dtype != kv_cache.dtype:
                kw, vw = kw.to(kv_cache.dtype), vw.to(kv_cache.dtype)
            flat[0].index_copy_(0, plan.write_slots, kw)
            flat[1].index_copy_(0, plan.write_slots, vw)
        if len(plan.groups) == 1 and plan.groups[0].tok_rows is None:  # one group, rows in order
            return self._group(
                plan, plan.groups[0], q, kv_cache, scale, sliding_window, logit_softcap
            )
        out = q.new_empty(q.shape[0], q.shape[1] * d)
        for g in plan.groups:
            o = self._group(plan, g, q, kv_cache, scale, sliding_window, logit_softcap)
            out.index_copy_(0, g.tok_rows, o.index_select(0, g.pad_rows))
        for r in plan.longs:
            rows = slice(r.start, r.start + r.qlen)
            out[rows] = self._long(
                r, q[rows], k[rows], v[rows], kv_cache, scale, sliding_window, logit_softcap
            )
        return out

    def _group(self, p: Plan, g: Group, q, kv_cache, scale, window, softcap) -> torch.Tensor:
        _, _, bs, hkv, d = kv_cache.shape
        hq = q.shape[1]
        groups = hq // hkv
        chunks = g.chunks(hkv * d * kv_cache.element_size())
        # Flat K/V workspace reused by every layer (stays cache-hot); layers may differ in shape.
        need = max(c.block_ids.numel() for c in chunks) * bs * hkv * d
        ws = p.workspace.get(kv_cache.dtype)
        if ws is None or ws.shape[1] < need:
            ws = p.workspace[kv_cache.dtype] = kv_cache.new_empty(2, need)
        if g.qmax == 1 and g.q_rows is None:  # plain decode batch: [Bg, Hq, D] is [Bg, Hkv, G, D]
            qg = q.view(g.n, hkv, groups, d)
        else:  # [Bg, Q, Hkv, G, D] -> [Bg, Hkv, G*Q, D]: one row block per KV head
            qg = q if g.q_rows is None else q.index_select(0, g.q_rows)  # [Bg*Q, Hq, D]
            qg = qg.view(g.n, g.qmax, hkv, groups, d).permute(0, 2, 3, 1, 4)
            qg = qg.reshape(g.n, hkv, groups * g.qmax, d)
        # fp32 caches: gather + SDPA is faster; 16-bit caches: the embedding_bag path (measured).
        bag = self.short_path == "bag" or (
            self.short_path == "auto" and kv_cache.dtype != torch.float32
        )
        blocks = kv_cache.view(2, -1, bs * hkv * d)  # [2, num_blocks, bs*Hkv*D]
        k_src, v_src = kv_cache[0].view(-1, d), kv_cache[1].view(-1, d)  # [slots*Hkv, D]
        outs = []
        for c in chunks:
            n, length, size = c.hi - c.lo, c.nblk * bs, c.block_ids.numel() * bs * hkv * d
            qc = qg if len(chunks) == 1 else qg[c.lo : c.hi]
            if not bag:  # gather whole K and V blocks (bigger copies than rows: faster)
                k_out = ws[0, :size].view(-1, bs * hkv * d)
                v_out = ws[1, :size].view(-1, bs * hkv * d)
                torch.index_select(blocks[0], 0, c.block_ids, out=k_out)
                torch.index_select(blocks[1], 0, c.block_ids, out=v_out)
                # [n*nblk, bs*Hkv*D] -> [n, L, Hkv, D] -> [n, Hkv, L, D] (strided views)
                k = k_out.view(n, length, hkv, d).transpose(1, 2).to(q.dtype)
                v = v_out.view(n, length, hkv, d).transpose(1, 2).to(q.dtype)
                mask = g.mask(c, window, q.dtype, groups)
                outs.append(sdpa(qc, k, v, mask, scale, softcap))
                continue
            # Keys gathered head-major, then P @ V by embedding_bag straight over the cache's
            # value rows: values are never copied.
            k_rows, v_bags = g.rows(c, hkv, groups)
            k = torch.index_select(k_src, 0, k_rows, out=ws[0, :size].view(-1, d))
            k = k.view(n, hkv, length, d).to(q.dtype)  # [n, Hkv, L, D]
            s = torch.matmul(qc, k.transpose(-1, -2)).float().mul_(scale)  # [n, Hkv, G*Q, L]
            if softcap is not None:
                s = torch.tanh(s.div_(softcap)).mul_(softcap)
            s += g.mask(c, window, torch.float32, groups)
            probs = torch.softmax(s, dim=-1).to(kv_cache.dtype).view(-1, length)
            o = F.embedding_bag(v_bags, v_src, mode="sum", per_sample_weights=probs)
            outs.append(o.view(n, hkv, groups * g.qmax, d).to(q.dtype))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [Bg, Hkv, G*Q, D]
        if g.qmax == 1:
            return o.reshape(g.n, hq * d)
        # [Bg, Hkv, G, Q, D] -> [Bg*Q, Hq*D]
        o = o.reshape(g.n, hkv, groups, g.qmax, d).permute(0, 3, 1, 2, 4)
        return o.reshape(g.n * g.qmax, hq * d)

    def _long(self, r: Long, q, k, v, kv_cache, scale, window, softcap) -> torch.Tensor:
        if r.ctx > 0:
            _, num_blocks, bs, hkv, d = kv_cache.shape
            kv = kv_cache.view(2, num_blocks, bs * hkv * d)[:, r.block_ids]
            kv = kv.view(2, -1, hkv, d).to(q.dtype)  # [2, nblk*bs, Hkv, D]
            if r.written:
                k, v = kv[0, : r.seq_len], kv[1, : r.seq_len]
            else:
                k = torch.cat([kv[0, : r.ctx], k])
                v = torch.cat([kv[1, : r.ctx], v])
        is_causal = r.plain_causal and window is None
        o = sdpa(
            q.transpose(0, 1)[None],  # [1, Hq, Q, D]
            k.transpose(0, 1)[None],  # [1, Hkv, L, D]
            v.transpose(0, 1)[None],
            r.mask(window, q.dtype),
            scale,
            softcap,
            is_causal,
        )
        return o[0].transpose(0, 1).reshape(r.qlen, -1)  # [Q, Hq*D]
