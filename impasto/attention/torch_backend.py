"""Plain-PyTorch reference attention backend (CPU and any torch device).

Requests are split in two kinds once per step (the "plan", shared by every layer):

- short queries (decodes, spec-decode verification, <= SHORT_QUERY_MAX tokens) whose new
  tokens are all written to the cache: their KV blocks are gathered into one padded batch
  `[Bg, Lmax, Hkv, D]` and attended with a single SDPA call, queries grouped per KV head;
- everything else (prefill chunks, diffusion canvases, read-only requests): one SDPA call per
  request over its cached prefix followed by its new keys.

Invariant used by the short path and by written long requests: the cache is written *before*
it is read, so the gathered context already holds this step's keys (bit-identical to `k`/`v`,
which have the cache dtype). Requests with any slot -1 never read their new keys from the cache.
Key index == key position in every path (context 0..ctx-1, then new tokens ctx..seq_len-1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from impasto.attention.backend import AttentionBackend
from impasto.attention.metadata import AttentionMetadata, get_forward_context

SHORT_QUERY_MAX = 16


def key_mask(
    q_pos: torch.Tensor,  # [B, Q] absolute query positions
    kv_len: torch.Tensor,  # [B] number of valid keys (positions 0..kv_len-1)
    causal: torch.Tensor,  # [B] bool
    num_keys: int,
    window: int | None,
) -> torch.Tensor:  # [B, Q, num_keys] bool, True = visible
    key = torch.arange(num_keys, device=q_pos.device)
    diff = q_pos[:, :, None] - key  # p - kp
    causal = causal[:, None, None]
    ok = (key < kv_len[:, None, None]) & ((diff >= 0) | ~causal)
    if window is not None:
        ok &= torch.where(causal, diff, diff.abs()) < window
    return ok


def _additive(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))


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


@dataclass
class _Group:
    """Short-query requests attended together on a padded batch."""

    n: int  # Bg
    block_size: int
    qmax: int
    nblk: int  # logical blocks gathered per request
    block_ids: torch.Tensor  # [Bg * nblk] physical blocks; 0 where past a request's end
    q_rows: torch.Tensor | None  # [Bg * qmax] token row per padded query; None = identity
    tok_rows: torch.Tensor | None  # [Tg] token rows produced; None = all T rows in order
    pad_rows: torch.Tensor | None  # [Tg] their index among the Bg * qmax padded rows
    q_pos: torch.Tensor  # [Bg, qmax]; pad rows repeat the last real query (never empty)
    seq_lens: torch.Tensor  # [Bg]
    causal: torch.Tensor  # [Bg] bool
    masks: dict = field(default_factory=dict)

    def mask(self, window: int | None, dtype: torch.dtype, groups: int) -> torch.Tensor:
        key = (window, dtype, groups)
        if key not in self.masks:
            num_keys = self.nblk * self.block_size
            ok = key_mask(self.q_pos, self.seq_lens, self.causal, num_keys, window)
            if self.qmax > 1:  # query rows are ordered (head-in-group, token)
                ok = ok.repeat(1, groups, 1)  # [Bg, G*Q, L]
            self.masks[key] = _additive(ok[:, None], dtype)  # [Bg, 1, G*Q or 1, L]
        return self.masks[key]


@dataclass
class _Long:
    """One request attended on its own (prefill chunk, canvas, read-only request)."""

    start: int
    qlen: int
    ctx: int
    seq_len: int
    causal: bool
    written: bool  # all new tokens written: read the whole sequence back from the cache
    block_ids: torch.Tensor  # blocks covering seq_len (written) or ctx (read-only)
    masks: dict = field(default_factory=dict)

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        if window is None and (not self.causal or self.ctx == 0):
            return None  # fully visible, or plain top-left causal (SDPA is_causal)
        key = (window, dtype)
        if key not in self.masks:
            dev = self.block_ids.device
            q_pos = torch.arange(self.ctx, self.seq_len, device=dev)[None]
            kv = torch.tensor([self.seq_len], device=dev)
            causal = torch.tensor([self.causal], device=dev)
            ok = key_mask(q_pos, kv, causal, self.seq_len, window)
            self.masks[key] = _additive(ok[:, None], dtype)  # [1, 1, Q, L]
        return self.masks[key]


@dataclass
class _Plan:
    write_slots: torch.Tensor | None  # [W] cache slots to write; None = nothing to write
    write_rows: torch.Tensor | None  # [W] token rows written; None = all rows
    group: _Group | None
    longs: list[_Long]
    workspace: dict = field(default_factory=dict)


def build_plan(meta: AttentionMetadata) -> _Plan:
    dev, bs = meta.slot_mapping.device, meta.block_size
    qlens, slens = meta.query_lens, meta.seq_lens
    starts = meta.query_start_loc.tolist()
    neg = meta.slot_mapping < 0
    if not bool(neg.any()):
        written = [True] * meta.num_reqs
        write_slots, write_rows = meta.slot_mapping, None
    else:
        c = torch.cat([neg.new_zeros(1, dtype=torch.int64), neg.cumsum(0)])
        written = (c[meta.query_start_loc[1:]] == c[meta.query_start_loc[:-1]]).tolist()
        write_rows = (~neg).nonzero().squeeze(1)
        write_slots = meta.slot_mapping[write_rows] if write_rows.numel() else None

    short = [b for b in range(meta.num_reqs) if 0 < qlens[b] <= SHORT_QUERY_MAX and written[b]]
    longs = []
    for b in range(meta.num_reqs):
        if qlens[b] == 0 or b in short:
            continue
        ctx = slens[b] - qlens[b]
        n = -(-(slens[b] if written[b] else ctx) // bs)
        blocks = meta.block_table[b, :n]
        longs.append(_Long(starts[b], qlens[b], ctx, slens[b], meta.causal[b], written[b], blocks))

    group = None
    if short:
        group = _build_group(meta, short, starts, dev, bs)
    return _Plan(write_slots, write_rows, group, longs)


def _build_group(
    meta: AttentionMetadata, idx: list[int], starts: list[int], dev: torch.device, bs: int
) -> _Group:
    ql = torch.tensor([meta.query_lens[b] for b in idx], device=dev)
    sl = torch.tensor([meta.seq_lens[b] for b in idx], device=dev)
    st = torch.tensor([starts[b] for b in idx], device=dev)
    qmax, nblk = int(ql.max()), -(-max(meta.seq_lens[b] for b in idx) // bs)
    everyone = len(idx) == meta.num_reqs
    bt = meta.block_table[:, :nblk] if everyone else meta.block_table[idx, :nblk]
    used = torch.arange(nblk, device=dev)[None] < (sl[:, None] + bs - 1) // bs
    block_ids = torch.where(used, bt, 0).reshape(-1)
    i = torch.minimum(torch.arange(qmax, device=dev)[None], ql[:, None] - 1)  # [Bg, qmax]
    q_pos = (sl - ql)[:, None] + i
    q_rows = (st[:, None] + i).reshape(-1)
    uniform = bool((ql == qmax).all())
    tok_rows = pad_rows = None
    if everyone and uniform:
        q_rows = None  # query rows are exactly q.view(Bg, qmax, ...)
    else:
        pad_rows = (torch.arange(qmax, device=dev)[None] < ql[:, None]).reshape(-1).nonzero()
        pad_rows = pad_rows.squeeze(1)
        tok_rows = q_rows[pad_rows]
    causal = torch.tensor([meta.causal[b] for b in idx], device=dev)
    rows = (q_rows, tok_rows, pad_rows)
    return _Group(len(idx), bs, qmax, nblk, block_ids, *rows, q_pos, sl, causal)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._key: tuple[object, object] | None = None
        self._plan: _Plan | None = None

    def plan(self, meta: AttentionMetadata) -> _Plan:
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
            flat[0].index_copy_(0, p.write_slots, kw.to(kv_cache.dtype))
            flat[1].index_copy_(0, p.write_slots, vw.to(kv_cache.dtype))
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

    def _group(self, p: _Plan, g: _Group, q, kv_cache, scale, window, softcap) -> torch.Tensor:
        _, num_blocks, bs, hkv, d = kv_cache.shape
        hq = q.shape[1]
        groups, length = hq // hkv, g.nblk * bs
        flat = kv_cache.view(2, num_blocks, bs * hkv * d)
        ws_key = (kv_cache.dtype, g.block_ids.numel(), bs * hkv * d)
        if ws_key not in p.workspace:  # reused by every layer: no allocation, stays cache-hot
            p.workspace[ws_key] = kv_cache.new_empty(2, *ws_key[1:])
        ws = p.workspace[ws_key]
        torch.index_select(flat[0], 0, g.block_ids, out=ws[0])
        torch.index_select(flat[1], 0, g.block_ids, out=ws[1])
        kv = ws.view(2, g.n, length, hkv, d).transpose(2, 3).to(q.dtype)  # [2, Bg, Hkv, L, D]
        qg = q if g.q_rows is None else q.index_select(0, g.q_rows)  # [Bg*Q, Hq, D]
        # [Bg, Q, Hkv, G, D] -> [Bg, Hkv, G*Q, D]: one SDPA row block per KV head
        qg = qg.view(g.n, g.qmax, hkv, groups, d).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(g.n, hkv, groups * g.qmax, d)
        o = sdpa(qg, kv[0], kv[1], g.mask(window, q.dtype, groups), scale, softcap)
        # [Bg, Hkv, G*Q, D] -> [Bg*Q, Hq*D]
        o = o.view(g.n, hkv, groups, g.qmax, d).permute(0, 3, 1, 2, 4)
        return o.reshape(g.n * g.qmax, hq * d)

    def _long(self, r: _Long, q, k, v, kv_cache, scale, window, softcap) -> torch.Tensor:
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
