"""The torch attention backend against a dense per-token reference."""

from __future__ import annotations

import math

import pytest
import torch

from impasto.attention import registry, torch_plan
from impasto.attention.backend import AttentionBackend, AttentionPlan
from impasto.attention.metadata import get_forward_context
from impasto.attention.registry import get_attention_backend, register_attention_backend
from impasto.attention.torch_backend import SHORT_QUERY_MAX, TorchAttentionBackend
from impasto.models.layers import Attention
from impasto.worker.forward import model_forward
from tests.models.harness import BlockAllocator, Seq, Work, build_metadata

BS = 4
# (context tokens already cached, new query tokens, causal, writes its KV)
MIXED = [
    (37, 1, True, True),  # decode
    (0, 1, True, True),  # one-token prompt
    (20, 4, True, True),  # spec-decode verification
    (16, 23, True, True),  # prefill chunk over a cached prefix
    (0, 19, True, True),  # first prefill chunk
    (12, 8, False, False),  # diffusion denoise: bidirectional canvas, read-only cache
    (5, 3, False, True),  # short bidirectional block, written (commit of a masked block)
    (9, 2, True, False),  # short read-only causal query
    (3, SHORT_QUERY_MAX + 1, False, True),  # long bidirectional, written
]


def dense_reference(q, keys, values, cases, scale, window, softcap):
    """Loop over every query token; keys/values[b]: the request's full sequence [L, Hkv, D]."""
    hq, hkv = q.shape[1], keys[0].shape[1]
    out, row = [], 0
    for (ctx, qlen, causal, _), kk, vv in zip(cases, keys, values, strict=True):
        for i in range(qlen):
            p = ctx + i
            vis = [
                kp
                for kp in range(ctx + qlen)
                if (not causal or kp <= p)
                and (window is None or (p - kp if causal else abs(p - kp)) < window)
            ]
            kv_head = torch.arange(hq) // (hq // hkv)
            k_sel = kk[vis][:, kv_head].double()  # [n, Hq, D]
            s = torch.einsum("hd,nhd->hn", q[row].double(), k_sel) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            o = torch.einsum("hn,nhd->hd", s.softmax(-1), vv[vis][:, kv_head].double())
            out.append(o.reshape(-1))
            row += 1
    return torch.stack(out)


def setup(cases, hq, hkv, d, dtype, seed=0, num_blocks=96):
    """Random cache prefix per request + random new q/k/v; returns everything to compare."""
    g = torch.Generator().manual_seed(seed)
    alloc = BlockAllocator(num_blocks, seed)
    cache = torch.randn(2, num_blocks, BS, hkv, d, generator=g).to(dtype)
    works, keys, values = [], [], []
    for ctx, qlen, causal, write in cases:
        seq = Seq([0] * (ctx + qlen), num_computed=ctx, causal=causal)
        seq.blocks = alloc.allocate(-(-(ctx + qlen) // BS))
        works.append(Work(seq, qlen, write))
    meta = build_metadata(works, BS)
    t = meta.num_tokens
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    row = 0
    for w, (ctx, qlen, _, _) in zip(works, cases, strict=True):
        slots = [w.seq.blocks[p // BS] * BS + p % BS for p in range(ctx)]
        flat = cache.view(2, -1, hkv, d)
        keys.append(torch.cat([flat[0, slots], k[row : row + qlen]]))
        values.append(torch.cat([flat[1, slots], v[row : row + qlen]]))
        row += qlen
    return meta, cache, q, k, v, keys, values


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("short_path", ["sdpa", "bag"])
def test_mixed_batch_matches_dense(hq, hkv, window, softcap, short_path):
    d = 16
    meta, cache, q, k, v, keys, values = setup(MIXED, hq, hkv, d, torch.float32)
    before = cache.clone()
    scale = 1 / math.sqrt(d)
    backend = TorchAttentionBackend(short_path)
    out = backend.forward(
        q, k, v, cache, meta, backend.build_plan(meta),
        scale=scale, sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    ref = dense_reference(q, keys, values, MIXED, scale, window, softcap)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    # The cache received exactly the written rows' k/v; read-only rows left it untouched.
    expect = before.view(2, -1, hkv, d).clone()
    keep = meta.slot_mapping >= 0
    expect[0, meta.slot_mapping[keep]] = k[keep]
    expect[1, meta.slot_mapping[keep]] = v[keep]
    assert torch.equal(cache.view(2, -1, hkv, d), expect)


@pytest.mark.parametrize(
    "cases",
    [
        [(c, 1, True, True) for c in (0, 3, 17, 40, 8)],  # pure decode: identity fast path
        [(c, 3, True, True) for c in (2, 9, 30)],  # uniform spec-decode batch
        [(c, q, True, True) for c, q in ((5, 1), (30, 4), (0, 2))],  # ragged short queries
        # decodes around one verification: split into a decode group and a verify group
        [(c, 5 if c == 12 else 1, True, True) for c in (3, 40, 12, 0, 7, 21, 9, 2, 30)],
        [(0, 25, True, True)],  # a lone prefill
    ],
)
@pytest.mark.parametrize("short_path", ["sdpa", "bag"])
def test_batch_shapes(cases, short_path):
    meta, cache, q, k, v, keys, values = setup(cases, 6, 2, 8, torch.float32, seed=1)
    backend = TorchAttentionBackend(short_path)
    out = backend.forward(q, k, v, cache, meta, backend.build_plan(meta), scale=0.3)
    torch.testing.assert_close(
        out.double(), dense_reference(q, keys, values, cases, 0.3, None, None), atol=2e-5, rtol=0
    )


@pytest.mark.parametrize("short_path", ["sdpa", "bag"])
def test_bf16_close_to_reference(short_path):
    meta, cache, q, k, v, keys, values = setup(MIXED, 6, 2, 16, torch.bfloat16, seed=2)
    backend = TorchAttentionBackend(short_path)
    out = backend.forward(
        q, k, v, cache, meta, backend.build_plan(meta), scale=0.25, sliding_window=9
    )
    assert out.dtype == torch.bfloat16
    ref = dense_reference(q, keys, values, MIXED, 0.25, 9, None)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_backend_registry():
    assert get_attention_backend() is get_attention_backend("torch")
    with pytest.raises(ValueError, match="torch"):
        get_attention_backend("flash")


class CountingBackend(AttentionBackend[AttentionPlan]):
    """A registered backend of its own (wrapping the torch one): counts plans and calls."""

    name = "counting"

    def __init__(self) -> None:
        self.inner = TorchAttentionBackend()
        self.plans: list[AttentionPlan] = []
        self.calls: list[AttentionPlan] = []  # the plan each layer call got

    def build_plan(self, metadata):
        self.plans.append(self.inner.build_plan(metadata))
        return self.plans[-1]

    def forward(self, q, k, v, kv_cache, metadata, plan, **kwargs):
        self.calls.append(plan)
        return self.inner.forward(q, k, v, kv_cache, metadata, plan, **kwargs)


def test_registered_backend_runs_unchanged_layers(monkeypatch):
    """A backend is added by registering its class: the layers take it (and one plan per
    forward, shared by every layer) from the forward context, and a new forward builds a new
    plan."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))  # undone after
    monkeypatch.setattr(registry, "_INSTANCES", dict(registry._INSTANCES))
    register_attention_backend("counting", __name__, "CountingBackend")
    backend = get_attention_backend("counting")
    assert isinstance(backend, CountingBackend) and backend is get_attention_backend("counting")
    meta, cache0, q, k, v, keys, values = setup(MIXED, 6, 2, 8, torch.float32, seed=3)
    cache1 = cache0.clone()
    ref = dense_reference(q, keys, values, MIXED, 0.5, None, None)
    layers = [Attention(6, 2, 8, i, scale=0.5) for i in range(2)]
    with model_forward(backend, meta, [cache0, cache1]):
        assert get_forward_context().backend is backend
        o0, o1 = (layer(q, k, v) for layer in layers)
    assert len(backend.plans) == 1 and backend.calls == [backend.plans[0]] * 2
    with model_forward(backend, meta, [cache0.clone(), cache1.clone()]):
        layers[0](q, k, v)
    assert len(backend.plans) == 2 and backend.calls[-1] is backend.plans[1] is not backend.plans[0]
    torch.testing.assert_close(o0.double(), ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(o1, o0)


@pytest.mark.parametrize("chunk_bytes", [1, 10000])
@pytest.mark.parametrize("short_path", ["sdpa", "bag"])
def test_short_queries_split_in_chunks(monkeypatch, chunk_bytes, short_path):
    """Tiny chunk budgets: one request per chunk, or a few requests padded per chunk."""
    monkeypatch.setattr(torch_plan, "CHUNK_BYTES", chunk_bytes)
    cases = [(c, q, c % 2 == 0, True) for c, q in ((3, 1), (30, 2), (0, 1), (12, 5), (50, 1))]
    meta, cache, q, k, v, keys, values = setup(cases, 6, 2, 8, torch.float32, seed=4)
    backend = TorchAttentionBackend(short_path)
    plan = backend.build_plan(meta)
    out = backend.forward(q, k, v, cache, meta, plan, scale=0.3, sliding_window=20)
    groups = plan.groups
    chunks = [c for g in groups for c in g.chunks(2 * 8 * 4)]  # Hkv * D * fp32 bytes
    assert len(chunks) == 5 if chunk_bytes == 1 else len(groups) <= len(chunks) < 5
    ref = dense_reference(q, keys, values, cases, 0.3, 20, None)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("short_path", ["sdpa", "bag"])
def test_layers_with_different_kv_shapes_share_a_step(short_path):
    """Models like Gemma mix layer shapes (KV heads, head dim) under one metadata."""
    backend = TorchAttentionBackend(short_path)
    shapes = [(6, 2, 8), (4, 1, 32), (6, 2, 8)]
    # Same seed: same block tables (one metadata); the random data differ with the shapes.
    setups = [setup(MIXED, hq, hkv, d, torch.float32, seed=5) for hq, hkv, d in shapes]
    meta = setups[0][0]
    plan = backend.build_plan(meta)  # one plan for the step's layers
    for _, cache, q, k, v, keys, values in setups:
        out = backend.forward(q, k, v, cache, meta, plan, scale=0.3)
        ref = dense_reference(q, keys, values, MIXED, 0.3, None, None)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


def test_decodes_split_from_long_verifications():
    """Padding many decodes to one long verification would multiply their work: two groups."""
    backend = TorchAttentionBackend()
    many = [(c, 5 if c == 12 else 1, True, True) for c in (3, 40, 12, 0, 7, 21, 9, 2, 30)]
    meta = setup(many, 6, 2, 8, torch.float32)[0]
    groups = backend.build_plan(meta).groups
    assert [g.qmax for g in groups] == [1, 5] and [g.n for g in groups] == [8, 1]
    # Padding is cheaper than a second pass for a few requests.
    two = [(c, 2 if c == 12 else 1, True, True) for c in (3, 40, 12, 0)]
    for few in ([(5, 1, True, True), (30, 4, True, True), (0, 3, True, True)], two):
        meta = setup(few, 6, 2, 8, torch.float32)[0]
        assert len(backend.build_plan(meta).groups) == 1
