"""The fused CPU kernels against the eager PyTorch they replace (and the dense reference)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from impasto import kernels
from impasto.attention.torch_backend import SHORT_QUERY_MAX, TorchAttentionBackend
from impasto.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from impasto.worker.device_prep import install_kernels
from tests.models.test_attention_backend import dense_reference, setup

HAVE_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
ops = kernels.load() if HAVE_COMPILER else None
pytestmark = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler for the CPU kernels")


def test_kernels_build_where_a_compiler_exists():
    assert ops is not None, "impasto/kernels/cpu_ops.cpp failed to build (see the warning)"


DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, atol: float = 0.0) -> None:
    # bf16: the kernels round once from float32, eager rounds after each op.
    rtol, atol = (1.6e-2, max(atol, 1.6e-2)) if dtype == torch.bfloat16 else (1e-5, max(atol, 1e-5))
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("rows,n", [(1, 576), (37, 64), (5, 100)])
def test_rms_norm_and_residual_add(dtype, gemma, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    x, r = (torch.randn(rows, n, generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(n, 1e-5, gemma=gemma).to(dtype)
    norm.weight.data = torch.randn(n, generator=g).to(dtype)
    want_y, want_sum = norm(x, r)
    want_plain = norm(x)
    norm.use_kernels(ops)
    got_y, got_sum = norm(x, r)
    assert torch.equal(got_sum, want_sum)  # the residual stream: one rounding of x + r
    close(got_y, want_y, dtype)
    close(norm(x), want_plain, dtype)


def test_rms_norm_of_strided_heads():
    """Qwen3's q/k norm: [T, H, D] views into the qkv projection."""
    qkv = torch.randn(3, 10 * 16).to(torch.bfloat16)
    heads = qkv[:, 16:96].view(3, 5, 16)
    norm = RMSNorm(16, 1e-6).to(torch.bfloat16)
    want = norm(heads)
    norm.use_kernels(ops)
    close(norm(heads), want, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9])
def test_silu_and_mul(dtype, rows):
    x = torch.randn(rows, 96).to(dtype) * 4  # wide range: the fast exp near the clamp too
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = x[:, :48], x[:, 48:]
    close(ops.silu_and_mul(x), F.silu(gate) * up, dtype)


def test_mlp_uses_the_kernel_for_decode_sized_inputs_only(monkeypatch):
    mlp = GatedMLP(32, 48).to(torch.bfloat16)
    assert mlp.fused_ops is None  # installed per model, never by default
    calls = []
    mlp.use_kernels(
        type("Ops", (), {"silu_and_mul": lambda self, x: calls.append(x) or x[:, 48:]})()
    )
    mlp(torch.randn(1, 32).to(torch.bfloat16))
    mlp(torch.randn(65, 32).to(torch.bfloat16))
    assert [c.shape[0] for c in calls] == [1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_in_place_on_qkv_views(dtype, partial):
    t, hq, hkv, d = 7, 6, 2, 32
    rope = RotaryEmbedding(d, {"rope_theta": 10000.0, "partial_rotary_factor": partial})
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    cos_sin = rope.cos_sin(torch.arange(100, 100 + t), dtype)
    qk = qkv[:, : (hq + hkv) * d].view(t, -1, d)
    want = rope(qk, cos_sin)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    rope.use_kernels(ops)
    got = rope(qk, cos_sin, inplace=True)
    assert got.data_ptr() == qkv.data_ptr()  # rotated where it lies
    close(got, want, dtype)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # values untouched
    assert rope(qk, cos_sin) is not qk  # without inplace: still a new tensor


# Every request a short query whose keys are written: the steps the fused attention takes.
SHORT = [
    (37, 1, True, True),  # decode
    (0, 1, True, True),  # one-token prompt
    (20, 4, True, True),  # spec-decode verification
    (9, SHORT_QUERY_MAX, True, True),
    (5, 3, False, True),  # short bidirectional block
    (130, 1, True, True),  # long context
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (9, 3)])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 20.0), (5, 30.0)])
def test_paged_attention_matches_dense(dtype, hq, hkv, window, softcap):
    d = 64
    meta, cache, q, k, v, keys, values = setup(SHORT, hq, hkv, d, dtype, seed=hq + hkv)
    ref = dense_reference(q, keys, values, SHORT, d**-0.5, window, softcap)
    want_cache = cache.clone()
    flat = want_cache.view(2, -1, hkv, d)
    flat[0, meta.slot_mapping], flat[1, meta.slot_mapping] = k, v
    causal = torch.tensor(meta.causal)
    out = ops.paged_attention(
        q, k, v, cache, meta.slot_mapping, meta.block_table, meta.query_start_loc,
        meta.seq_lens_t, causal, d**-0.5, window or 0, softcap or 0.0,
    )  # fmt: skip
    assert torch.equal(cache, want_cache)  # the step's keys/values written at their slots
    close(out, ref.to(dtype), dtype, atol=2e-5)


def test_backend_takes_the_fused_path_for_bf16_decode_steps():
    """Through the backend: bf16 all-short steps use the kernel, its output is close to bag's."""
    hq, hkv, d = 6, 2, 64
    meta, cache, q, k, v, *_ = setup(SHORT, hq, hkv, d, torch.bfloat16, seed=3)
    fused_cache, bag_cache = cache.clone(), cache.clone()
    fused, bag = TorchAttentionBackend(), TorchAttentionBackend(short_path="bag")
    plan = fused.build_plan(meta)
    assert plan.all_short and plan.fused_short_queries(fused_cache, q.dtype) is not None
    got = fused.forward(q, k, v, fused_cache, meta, plan, scale=d**-0.5)
    bag_plan = bag.build_plan(meta)
    assert bag_plan.fused_short_queries(bag_cache, q.dtype) is None  # "bag" never fuses
    want = bag.forward(q, k, v, bag_cache, meta, bag_plan, scale=d**-0.5)
    assert torch.equal(fused_cache, bag_cache)
    close(got, want, torch.bfloat16)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 70])
@pytest.mark.parametrize("cols", [576, 100, 37])  # the vector path, its remainder, odd widths
@pytest.mark.parametrize("bias", [False, True])
def test_linear_bf16_matches_float_reference(rows, cols, bias):
    g = torch.Generator().manual_seed(rows * cols)
    w = torch.randn(67, cols, generator=g).to(torch.bfloat16)  # 67: a partial row block
    b = torch.randn(67, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 2 * cols, generator=g).to(torch.bfloat16)[:, ::2]  # strided rows
    x = x.contiguous() if cols == 37 else x[:, :cols]
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = ops.linear_bf16(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 67)
    # float32 accumulation, one rounding: within bf16's half-ulp of the exact result.
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-3)


def test_linear_bf16_keeps_leading_dims():
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    w = torch.randn(16, 64).to(torch.bfloat16)
    got = ops.linear_bf16(x, w)
    assert got.shape == (2, 3, 16)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=8e-3, atol=1e-3)


def test_install_switches_bf16_models_only():
    from impasto.models.layers import ReplicatedLinear
    from impasto.models.layers.packed import plain_linear

    bf16 = torch.nn.Sequential(ReplicatedLinear(8, 8), RMSNorm(8)).to(torch.bfloat16)
    fp32 = torch.nn.Sequential(ReplicatedLinear(8, 8), RMSNorm(8))
    assert install_kernels(fp32) == 0 and fp32[0].linear is plain_linear
    assert fp32[1].fused_ops is None
    assert install_kernels(bf16) == 2
    assert bf16[0].linear is ops.linear_bf16 and bf16[1].fused_ops is ops


def test_ninja_found_without_an_activated_environment(monkeypatch, tmp_path):
    """torch builds with `ninja` from PATH; the pip-installed one must be found regardless."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("ninja") is None
    kernels._put_ninja_on_path()
    assert shutil.which("ninja") is not None
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
