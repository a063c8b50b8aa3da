"""Smoke tests of the GGUF peer benchmarks (`benchmarks/gguf_agreement.py`,
`benchmarks/quantized.py`, `benchmarks/peers/llamacpp_gguf.py`), cheap and without llama.cpp
or vLLM.

What runs: the impasto parts of both scripts on a tiny random checkpoint (teacher-forced
logprobs checked against transformers' logits, the throughput / prefill / speculative workloads,
the bandwidth probe, the tables), and the llama.cpp driver's statistics and its greedy
draft/verify loop over a fake engine. Not run here (they need llama-cpp-python in its own
virtualenv, and the real GGUF models): the driver's ctypes calls into llama.cpp and the
scripts' end-to-end runs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from tests.fixtures import one_torch_thread
from tests.models import checkpoints

__all__ = ["one_torch_thread"]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ENGINE_ARGS = {"skip_tokenizer_init": True, "block_size": 4}


def load_script(relpath: str) -> ModuleType:
    name = "_peer_script_" + relpath.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / relpath)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return checkpoints.build_checkpoint(
        tmp_path_factory.mktemp("peer_tiny"), "llama", init_scale=3.0, vocab_size=160
    )


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> Path:
    return checkpoints.build_checkpoint(
        tmp_path_factory.mktemp("peer_draft"),
        "llama",
        init_scale=3.0,
        vocab_size=160,
        num_hidden_layers=1,
        hidden_size=32,
    )


def test_logit_stats_matches_torch():
    driver = load_script("peers/llamacpp_gguf.py")
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 4
    nxt = rng.integers(0, 50, size=6)
    s = driver.logit_stats(logits, nxt, 3)
    lp = torch.from_numpy(logits).double().log_softmax(-1)
    top = lp.topk(3, dim=-1)
    assert s["argmax"] == top.indices[:, 0].tolist()
    np.testing.assert_allclose(s["top_lps"], top.values.numpy(), atol=1e-5)
    np.testing.assert_allclose(s["gap"], (top.values[:, 0] - top.values[:, 1]).numpy(), atol=1e-5)
    np.testing.assert_allclose(s["nll"], -lp[torch.arange(6), nxt].numpy(), atol=1e-5)


def test_agreement_impasto_child_vs_transformers(tiny):
    """impasto's prompt_logprobs, read as the script reads them, against transformers' logits
    through the driver's statistics: same argmax everywhere, same NLL (fp32, same weights)."""
    agree = load_script("gguf_agreement.py")
    driver = load_script("peers/llamacpp_gguf.py")
    ids = np.random.default_rng(1).integers(3, 160, size=80).tolist()
    windows = agree.make_windows(ids, 1, 80, 24)
    assert len(windows) == 3 and all(w[0] == 1 and len(w) == 24 for w in windows)
    assert agree.make_windows(ids, None, 80, 24)[1] == ids[24:48]
    spec = {"model": str(tiny), "windows": windows, "k": 4, "threads": 1, "dtype": "float32"}
    mine = agree.impasto_child({**spec, "engine_args": ENGINE_ARGS})
    hf = checkpoints.hf_model(tiny)
    ref: dict = {f: [] for f in agree.FIELDS}
    with torch.inference_mode():
        for w in windows:
            logits = hf(torch.tensor([w])).logits[0, :-1].numpy()
            for key, val in driver.logit_stats(logits, np.asarray(w[1:]), 4).items():
                ref[key] += val
    assert len(mine["nll"]) == 3 * 23
    row = agree.compare(mine, ref, None)
    assert row["agree"] == 1.0 and row["disagreements"] == 0
    assert row["mean_abs_dnll"] < 1e-3 and abs(row["ppl_rel"]) < 1e-3
    np.testing.assert_allclose(mine["gap"], ref["gap"], atol=1e-3)
    # a disagreement is reported with the reference's gap there
    flipped = dict(mine, argmax=list(mine["argmax"]))
    flipped["argmax"][5] = ref["top_ids"][5][1]
    row = agree.compare(flipped, ref, ref)
    assert row["disagreements"] == 1 and row["gap_max"] == pytest.approx(ref["gap"][5])
    assert row["margin_max"] == pytest.approx(ref["gap"][5], abs=1e-6)
    assert row["agree_yardstick"] == pytest.approx(1 - 1 / len(ref["argmax"]))
    agree.print_table("tiny", {"arch": "llama", "types": ["F32"]}, {"x": row}, "ref", "y")


def test_quantized_impasto_children(tiny, tiny_draft, capsys):
    q = load_script("quantized.py")
    args = type("A", (), dict(new_tokens=6, prompt_len=5, batch=3, prefill_len=20))()
    ids = np.random.default_rng(2).integers(3, 160, size=60).tolist()
    workloads = q.make_workloads(ids, args)
    assert [len(w["prompts"]) for w in workloads.values()] == [1, 3, 1]
    spec = {
        "model": str(tiny),
        "workloads": workloads,
        "threads": 1,
        "repeats": 1,
        "dtype": "float32",
        "kv_bytes": 4 << 20,
        "engine_args": ENGINE_ARGS,
        "max_model_len": 128,
    }
    res = q.impasto_bench(spec)
    outs = res["workloads"]
    assert [len(o) for o in outs["batch3"]["outputs"]] == [6, 6, 6]
    assert outs["prefill"]["outputs"] == [outs["prefill"]["outputs"][0]]
    hf = checkpoints.hf_model(tiny)
    assert outs["batch1"]["outputs"][0] == checkpoints.hf_greedy(
        hf, workloads["batch1"]["prompts"][0], 6
    )
    assert 0 < res["kv_bytes"] <= 4 << 20 and res["decode_weight_bytes"] > 0
    info = {"arch": "llama", "file_bytes": 1, "types": ["F32"], "decode_weight_bytes": 1}
    figs = {"impasto": q.summarize(res, info, 3, 20)}
    figs["llama.cpp"] = dict(figs["impasto"], b1_tok_s=figs["impasto"]["b1_tok_s"] / 2)
    bw = q.bandwidth({"threads": 1, "bytes": 16 << 20, "reps": 2})
    shape = dict(prompt_len=5, batch=3, prefill_len=20, new_tokens=6, impasto_dtype="float32")
    q.print_model("tiny", info, figs, bw, {"note": "x"}, shape)
    assert "2.00x" in capsys.readouterr().out
    # a peer that loaded nothing (vLLM without a GGUF method): its reason, no empty table
    q.print_model("tiny", info, {}, bw, {"vLLM": "vLLM 0.32.0 did not load the file"}, shape)
    out = capsys.readouterr().out
    assert "did not load the file" in out and "|" not in out

    sp = q.impasto_spec(
        {
            "model": str(tiny),
            "draft": str(tiny_draft),
            "prompts": [ids[:7], ids[7:12]],
            "k": 3,
            "new_tokens": 8,
            "threads": 1,
            "dtype": "float32",
            "engine_args": ENGINE_ARGS,
            "max_model_len": 128,
        }
    )
    assert sp["speculative"]["outputs"] == sp["baseline"]["outputs"]
    assert sp["speculative"]["drafted"] > 0
    q.print_spec("tiny", {"impasto": q.spec_figures(sp)})
    assert "2/2" in capsys.readouterr().out


class FakeEngine:
    """Stands in for the driver's llama.cpp `Engine`: a deterministic 'model' (next token =
    a hash of the whole prefix) whose KV cache is a list that decode must extend in order."""

    n_vocab = 7

    def __init__(self, path: str, threads: int, n_seq: int, n_ctx_seq: int, n_batch: int):
        self.salt = 0 if path == "target" else 1
        self.kv: list[int] = []

    def next_token(self, prefix: list[int]) -> int:
        h = sum((i + 1) * t for i, t in enumerate(prefix)) + len(prefix)
        if self.salt and len(prefix) % 3 == 0:  # the draft is wrong now and then
            h += 1
        return h % self.n_vocab

    def clear(self) -> None:
        self.kv = []

    def seq_rm(self, seq: int, p0: int) -> None:
        del self.kv[p0:]

    def decode(self, items):
        rows = []
        for tok, pos, _seq, want in items:
            assert pos == len(self.kv), (pos, len(self.kv))
            self.kv.append(tok)
            if want:
                rows.append(np.eye(self.n_vocab)[self.next_token(self.kv)])
        return rows

    def prefill(self, prompts, seqs=None):
        return [
            int(self.decode([(t, i, 0, i == len(p) - 1) for i, t in enumerate(p)])[0].argmax())
            for p in prompts
        ]

    def greedy(self, prompts, new_tokens):
        self.clear()
        outs = [self.prefill(prompts)]
        while len(outs[0]) < new_tokens:
            outs[0].append(int(self.decode([(outs[0][-1], len(self.kv), 0, True)])[0].argmax()))
        return outs, 0.0


def test_llamacpp_driver_speculative_loop_is_greedy():
    """The driver's draft/verify loop (with its KV bookkeeping) reproduces plain greedy."""
    driver = load_script("peers/llamacpp_gguf.py")
    spec = {
        "model": "target",
        "draft": "draft",
        "prompts": [[1, 2, 3], [4, 5, 6, 0, 2]],
        "k": 3,
        "new_tokens": 17,
        "threads": 1,
    }
    res = driver.run_spec(spec, engine=FakeEngine)
    assert res["speculative"]["outputs"] == res["baseline"]["outputs"]
    assert all(len(o) == 17 for o in res["speculative"]["outputs"])
    s = res["speculative"]
    assert 0 < s["accepted"] < s["drafted"] and s["steps"] < 2 * 16
