"""Plain-PyTorch reference attention backend (CPU and any torch device).

Per layer: write the step's k/v into the paged cache, then
- short-query requests (see `torch_plan`): per chunk of requests, gather their keys into a
  reused workspace `[n, Hkv, L, D]`, scores by one matmul with the queries grouped per KV head
  (`[n, Hkv, G*Q, D]`, so GQA needs no K/V repeat), fp32 softmax, and P @ V by `embedding_bag`
  over the cache's value rows (no value copy: ~1/3 less memory traffic than gather + SDPA);
- other requests: one SDPA each over the cached prefix and the new keys.

Invariant: the cache is written *before* it is read, so for requests whose slots are all
written the gathered context already holds this step's keys (bit-identical to `k`/`v` when the
cache has the model dtype). Requests with any slot -1 never read their new keys from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from impasto.attention.backend import AttentionBackend
from impasto.attention.metadata import AttentionMetadata, get_forward_context
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


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._key: tuple[object, object] | None = None
        self._plan: Plan | None = None

    def plan(self, meta: AttentionMetadata) -> Plan:
        """The step's plan, built once per forward_context and reused by every layer."""
        try:
            fc = get_forward_context()
        except RuntimeError:
            return build_plan(meta)  # called bare (tests): no caching
        if self._key is None or self._key[0] is not fc or self._key[1] is not meta:
            self._key, self._plan = (fc, meta), build_plan(meta)
        assert self._plan is not None
        return self._plan

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        p = self.plan(meta)
        _, num_blocks, bs, hkv, d = kv_cache.shape
        if p.write_slots is not None:  # write first: short and written requests read it back
            flat = kv_cache.view(2, num_blocks * bs, hkv, d)
            kw, vw = (k, v) if p.write_rows is None else (k[p.write_rows], v[p.write_rows])
            if kw.dtype != kv_cache.dtype:
                kw, vw = kw.to(kv_cache.dtype), vw.to(kv_cache.dtype)
            flat[0].index_copy_(0, p.write_slots, kw)
            flat[1].index_copy_(0, p.write_slots, vw)
        g = p.group
        if g is not None and g.tok_rows is None and not p.longs:
            return self._group(p, g, q, kv_cache, scale, sliding_window, logit_softcap)
        out = q.new_empty(q.shape[0], q.shape[1] * d)
        if g is not None:
            o = self._group(p, g, q, kv_cache, scale, sliding_window, logit_softcap)
            if g.tok_rows is None:
                out.copy_(o)
            else:
                out.index_copy_(0, g.tok_rows, o.index_select(0, g.pad_rows))
        for r in p.longs:
            rows = slice(r.start, r.start + r.qlen)
            out[rows] = self._long(
                r, q[rows], k[rows], v[rows], kv_cache, scale, sliding_window, logit_softcap
            )
        return out

    def _group(self, p: Plan, g: Group, q, kv_cache, scale, window, softcap) -> torch.Tensor:
        """Short queries: gather keys, scores by matmul, fp32 softmax, then P @ V computed by
        `embedding_bag` straight from the cache (values are never copied)."""
        _, _, bs, hkv, d = kv_cache.shape
        hq = q.shape[1]
        groups = hq // hkv
        k_src, v_src = kv_cache[0].view(-1, d), kv_cache[1].view(-1, d)  # [slots*Hkv, D]
        chunks = g.chunks(hkv * d * kv_cache.element_size())
        ws_key = (kv_cache.dtype, d)
        need = max(c.block_ids.numel() for c in chunks) * bs * hkv
        ws = p.workspace.get(ws_key)
        if ws is None or ws.shape[0] < need:  # reused by every layer: stays cache-hot
            ws = p.workspace[ws_key] = kv_cache.new_empty(need, d)
        if g.qmax == 1 and g.q_rows is None:  # plain decode batch: [Bg, Hq, D] is [Bg, Hkv, G, D]
            qg = q.view(g.n, hkv, groups, d)
        else:  # [Bg, Q, Hkv, G, D] -> [Bg, Hkv, G*Q, D]: one row block per KV head
            qg = q if g.q_rows is None else q.index_select(0, g.q_rows)  # [Bg*Q, Hq, D]
            qg = qg.view(g.n, g.qmax, hkv, groups, d).permute(0, 2, 3, 1, 4)
            qg = qg.reshape(g.n, hkv, groups * g.qmax, d)
        outs = []
        for c in chunks:
            n, length = c.hi - c.lo, c.nblk * bs
            k_rows, v_bags = g.rows(c, hkv, groups)
            k = torch.index_select(k_src, 0, k_rows, out=ws[: k_rows.numel()])
            k = k.view(n, hkv, length, d).to(q.dtype)  # [n, Hkv, L, D]
            qc = qg if len(chunks) == 1 else qg[c.lo : c.hi]
            s = torch.matmul(qc, k.transpose(-1, -2)).float().mul_(scale)  # [n, Hkv, G*Q, L]
            if softcap is not None:
                s = torch.tanh(s.div_(softcap)).mul_(softcap)
            s += g.mask(c, window, torch.float32, groups)
            probs = torch.softmax(s, dim=-1).to(kv_cache.dtype).view(-1, length)
            o = F.embedding_bag(v_bags, v_src, mode="sum", per_sample_weights=probs)
            outs.append(o.view(n, hkv, groups * g.qmax, d))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [Bg, Hkv, G*Q, D]
        o = o.to(q.dtype)
        if g.qmax == 1:
            return o.view(g.n, hq * d)
        # [Bg, Hkv, G, Q, D] -> [Bg*Q, Hq*D]
        o = o.view(g.n, hkv, groups, g.qmax, d).permute(0, 3, 1, 2, 4)
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
        is_causal = r.causal and r.ctx == 0 and window is None
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
