"""Per-step plan of the torch attention backend: built once from the metadata, used by all layers.

Requests are split in two kinds:

- short queries (decodes, spec-decode verification, <= SHORT_QUERY_MAX tokens) whose new
  tokens are all written to the cache: attended together on padded batches ("chunks"); plain
  decodes and multi-token queries form separate groups when padding every decode to the
  longest query would cost more than a second pass (one request verifying 4 drafts must not
  make 15 plain decodes attend 5 padded queries each);
- everything else (prefill chunks, diffusion canvases, read-only requests): one at a time.

Key index == key position in every path (context 0..ctx-1, then new tokens ctx..seq_len-1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from impasto.attention.backend import AttentionPlan
from impasto.attention.metadata import AttentionMetadata

SHORT_QUERY_MAX = 16
# Gathered key bytes per short-query chunk: small enough to stay in the CPU's L2/L3 between the
# gather and its use (2-core box, B=64 decode: ~1.6x faster than one padded batch).
CHUNK_BYTES = 4 << 20


def key_mask(
    q_pos: torch.Tensor,  # [B, Q] absolute query positions
    kv_len: torch.Tensor,  # [B] number of valid keys (positions 0..kv_len-1)
    causal: torch.Tensor,  # [B] bool
    num_keys: int,
    window: int | None,
    block: int = 1,
) -> torch.Tensor:  # [B, Q, num_keys] bool, True = visible
    """`block` > 1: block-causal (every request of the call): keys below the end of the
    query's block are visible, i.e. its own block bidirectionally and all blocks before it."""
    key = torch.arange(num_keys, device=q_pos.device)
    if block > 1:
        end = (torch.div(q_pos, block, rounding_mode="floor") + 1) * block  # [B, Q]
        diff = end[:, :, None] - 1 - key  # >= 0: visible
    else:
        diff = q_pos[:, :, None] - key  # p - kp
    causal = causal[:, None, None]
    ok = (key < kv_len[:, None, None]) & ((diff >= 0) | ~causal)
    if window is not None:
        ok &= torch.where(causal, diff, diff.abs()) < window
    return ok


def additive(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))


@dataclass
class Chunk:
    """Requests [lo, hi) of a group, padded to `nblk` blocks each."""

    lo: int
    hi: int
    nblk: int
    block_ids: torch.Tensor  # [(hi - lo) * nblk] physical blocks; 0 past a request's end
    masks: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)


@dataclass
class Group:
    """Short-query requests attended on padded batches, queries grouped per KV head."""

    n: int  # Bg
    block_size: int
    qmax: int
    nblks: list[int]  # blocks used by each request
    block_table: torch.Tensor  # [Bg, max(nblks)], 0 past each request's end
    q_rows: torch.Tensor | None  # [Bg * qmax] token row per padded query; None = identity
    tok_rows: torch.Tensor | None  # [Tg] token rows produced; None = all T rows in order
    pad_rows: torch.Tensor | None  # [Tg] their index among the Bg * qmax padded rows
    q_pos: torch.Tensor  # [Bg, qmax]; pad rows repeat the last real query (never empty)
    seq_lens: torch.Tensor  # [Bg]
    causal: torch.Tensor  # [Bg] bool
    _chunks: dict = field(default_factory=dict)

    def chunks(self, token_bytes: int) -> list[Chunk]:
        """Greedy split so that each chunk's gathered keys fit CHUNK_BYTES (>= 1 request)."""
        if token_bytes not in self._chunks:
            out, lo, per_req = [], 0, self.block_size * token_bytes
            while lo < self.n:
                hi, mx = lo + 1, self.nblks[lo]
                while (
                    hi < self.n and (hi + 1 - lo) * max(mx, self.nblks[hi]) * per_req <= CHUNK_BYTES
                ):
                    mx, hi = max(mx, self.nblks[hi]), hi + 1
                out.append(Chunk(lo, hi, mx, self.block_table[lo:hi, :mx].reshape(-1)))
                lo = hi
            self._chunks[token_bytes] = out
        return self._chunks[token_bytes]

    def rows(self, c: Chunk, hkv: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows (`slot * Hkv + kv_head` of the cache viewed as [slots * Hkv, D]) of the
        chunk's keys: K rows [n*Hkv*L] in gather order, and V bags [n*Hkv*G*Q, L]: one bag of
        L rows per query row, ordered like the scores (request, KV head, head-in-group, token)."""
        key = (hkv, groups)
        if key not in c.rows:
            bs, n, length = self.block_size, c.hi - c.lo, c.nblk * self.block_size
            dev = c.block_ids.device
            slots = (c.block_ids.view(n, c.nblk, 1) * bs + torch.arange(bs, device=dev)).view(
                n, length
            )
            k_rows = slots[:, None, :] * hkv + torch.arange(hkv, device=dev)[None, :, None]
            bags = k_rows[:, :, None, :].expand(n, hkv, groups * self.qmax, length)
            c.rows[key] = (k_rows.reshape(-1), bags.reshape(-1, length))
        return c.rows[key]

    def mask(self, c: Chunk, window: int | None, dtype: torch.dtype, groups: int) -> torch.Tensor:
        key = (window, dtype, groups)
        if key not in c.masks:
            s = slice(c.lo, c.hi)
            num_keys = c.nblk * self.block_size
            ok = key_mask(self.q_pos[s], self.seq_lens[s], self.causal[s], num_keys, window)
            if self.qmax > 1:  # query rows are ordered (head-in-group, token)
                ok = ok.repeat(1, groups, 1)  # [n, G*Q, L]
            c.masks[key] = additive(ok[:, None], dtype)  # [n, 1, G*Q or 1, L]
        return c.masks[key]


@dataclass
class Long:
    """One request attended on its own (prefill chunk, canvas, read-only request)."""

    start: int
    qlen: int
    ctx: int
    seq_len: int
    causal: bool
    written: bool  # all new tokens written: read the whole sequence back from the cache
    block_ids: torch.Tensor  # blocks covering seq_len (written) or ctx (read-only)
    block: int = 1  # > 1: block-causal with this block size (AttentionMetadata.causal_block)
    masks: dict = field(default_factory=dict)

    @property
    def plain_causal(self) -> bool:
        """Top-left causal with no context: SDPA's is_causal, no mask tensor."""
        return self.causal and self.ctx == 0 and self.block == 1

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        if window is None and (not self.causal or self.plain_causal):
            return None  # fully visible, or plain top-left causal (SDPA is_causal)
        key = (window, dtype)
        if key not in self.masks:
            dev = self.block_ids.device
            q_pos = torch.arange(self.ctx, self.seq_len, device=dev)[None]
            kv = torch.tensor([self.seq_len], device=dev)
            causal = torch.tensor([self.causal], device=dev)
            ok = key_mask(q_pos, kv, causal, self.seq_len, window, self.block)
            self.masks[key] = additive(ok[:, None], dtype)  # [1, 1, Q, L]
        return self.masks[key]


@dataclass
class Plan(AttentionPlan):
    write_slots: torch.Tensor | None  # [W] cache slots to write; None = nothing to write
    write_rows: torch.Tensor | None  # [W] token rows written; None = all rows
    build_groups: Callable[[], list[Group]]
    longs: list[Long]
    # Every request is a short query whose keys are all written (decode / verification steps):
    # the fused kernel can take the whole step.
    all_short: bool = False
    # causal_t: [B] bool, set when every request's keys are all written (the fused kernel can
    # take the step: always when short, and for reproducible attention whatever the lengths).
    causal_t: torch.Tensor | None = None
    # The kernel ops, set by the backend when the fused paged attention may take this step
    # (all keys written, its short path "auto", the kernels loaded); the cache's dtype and
    # device are checked per layer (`fused_short_queries`, `fused_reproducible`).
    fused_ops: Any = None
    workspace: dict = field(default_factory=dict)
    _groups: list[Group] | None = None

    def fused_short_queries(
        self, kv_cache: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """See AttentionPlan: a bf16 CPU cache and queries of the cache's dtype."""
        if not self.all_short or self.fused_ops is None or kv_cache.dtype != torch.bfloat16:
            return None
        if kv_cache.device.type != "cpu" or dtype != kv_cache.dtype:
            return None
        return self.causal_t

    def fused_reproducible(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """The [B] causal flags if the fused kernel can take this whole step for a layer that
        wants reproducible attention (every key written, a bf16 or float32 CPU cache of the
        queries' dtype), else None."""
        if self.fused_ops is None or self.causal_t is None or dtype != kv_cache.dtype:
            return None
        if kv_cache.device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
            return None
        return self.causal_t

    @property
    def groups(self) -> list[Group]:
        """Short-query groups (0, 1 or 2), their token rows disjoint; built on first use (a
        step taken whole by the fused kernel never needs them)."""
        if self._groups is None:
            self._groups = self.build_groups()
        return self._groups


def build_plan(meta: AttentionMetadata) -> Plan:
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

    # Block-causal requests are attended alone (their masks are per block, not per token).
    blk = meta.causal_block or [1] * meta.num_reqs
    short = [
        b
        for b in range(meta.num_reqs)
        if 0 < qlens[b] <= SHORT_QUERY_MAX and written[b] and blk[b] == 1
    ]
    is_short = set(short)
    longs = []
    for b in range(meta.num_reqs):
        if qlens[b] == 0 or b in is_short:
            continue
        ctx = slens[b] - qlens[b]
        n = -(-(slens[b] if written[b] else ctx) // bs)
        blocks = meta.block_table[b, :n]
        longs.append(
            Long(starts[b], qlens[b], ctx, slens[b], meta.causal[b], written[b], blocks, blk[b])
        )

    def build_groups() -> list[Group]:
        return [_build_group(meta, part, starts, dev, bs) for part in _split_short(meta, short)]

    all_short = len(short) == meta.num_reqs > 0
    # The fused kernels know token-causal and bidirectional requests only.
    all_written = meta.num_reqs > 0 and all(written) and max(blk) == 1
    causal_t = torch.tensor(meta.causal, device=dev) if all_written else None
    return Plan(write_slots, write_rows, build_groups, longs, all_short, causal_t)


# A second group costs a fixed set of kernel launches per layer (~5 ms a step for a 30-layer
# model on CPU); split only when padding the decodes to the longest query would add at least
# this factor and this many attended query rows (measured: 4 decodes and one 2-token query run
# faster padded, 15 decodes + one 5-token query faster split).
_SPLIT_FACTOR = 1.5
_SPLIT_MIN_ROWS = 8


def _split_short(meta: AttentionMetadata, short: list[int]) -> list[list[int]]:
    """The short requests as one group, or as (plain decodes, multi-token queries)."""
    if not short:
        return []
    ones = [b for b in short if meta.query_lens[b] == 1]
    multi = [b for b in short if meta.query_lens[b] > 1]
    if not ones or not multi:
        return [short]
    padded = len(short) * max(meta.query_lens[b] for b in multi)
    split = len(ones) + len(multi) * max(meta.query_lens[b] for b in multi)
    worth = padded >= _SPLIT_FACTOR * split and padded - split >= _SPLIT_MIN_ROWS
    return [ones, multi] if worth else [short]


def _build_group(
    meta: AttentionMetadata, idx: list[int], starts: list[int], dev: torch.device, bs: int
) -> Group:
    ql = torch.tensor([meta.query_lens[b] for b in idx], device=dev)
    sl = torch.tensor([meta.seq_lens[b] for b in idx], device=dev)
    st = torch.tensor([starts[b] for b in idx], device=dev)
    nblks = [-(-meta.seq_lens[b] // bs) for b in idx]
    qmax, nblk = int(ql.max()), max(nblks)
    everyone = len(idx) == meta.num_reqs
    bt = meta.block_table[:, :nblk] if everyone else meta.block_table[idx, :nblk]
    used = torch.arange(nblk, device=dev)[None] < torch.tensor(nblks, device=dev)[:, None]
    bt = torch.where(used, bt, 0)
    i = torch.minimum(torch.arange(qmax, device=dev)[None], ql[:, None] - 1)  # [Bg, qmax]
    q_pos = (sl - ql)[:, None] + i
    q_rows = (st[:, None] + i).reshape(-1)
    tok_rows = pad_rows = None
    if everyone and bool((ql == qmax).all()):
        q_rows = None  # query rows are exactly q.view(Bg, qmax, ...)
    else:
        pad_rows = (torch.arange(qmax, device=dev)[None] < ql[:, None]).reshape(-1).nonzero()
        pad_rows = pad_rows.squeeze(1)
        tok_rows = q_rows[pad_rows]
    causal = torch.tensor([meta.causal[b] for b in idx], device=dev)
    rows = (q_rows, tok_rows, pad_rows)
    return Group(len(idx), bs, qmax, nblks, bt, *rows, q_pos, sl, causal)
