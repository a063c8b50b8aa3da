"""End to end, random sampling: the first tokens generated with speculation follow the target's
exact joint distribution (computed with transformers), for both proposers, on a tiny model with
an 8-token vocabulary. Per-request seeds make the test deterministic."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from impasto import SamplingParams
from tests.entrypoints.conftest import build_checkpoint

from .conftest import generate, make_llm, metrics
from .test_rejection_sampler import tv, tv_threshold

VOCAB, NUM_TOKENS, N, TEMPERATURE = 8, 3, 3000, 1.5
PROMPT = [1, 2, 3, 1, 2, 3, 4, 1, 2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = build_checkpoint(tmp_path_factory.mktemp("dist_t"), "llama", vocab_size=VOCAB)
    draft = build_checkpoint(
        tmp_path_factory.mktemp("dist_d"), "llama", vocab_size=VOCAB, num_hidden_layers=1
    )
    return target, draft


def exact_joint(path) -> np.ndarray:
    """P(t0, t1, t2 | PROMPT) under softmax(logits / T), flattened to VOCAB**3 (row-major)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs = [list(s) for s in itertools.product(range(VOCAB), repeat=NUM_TOKENS - 1)]
    ids = torch.tensor([PROMPT + s for s in seqs])  # [V^2, P + 2]
    with torch.no_grad():
        logits = model(ids).logits[:, len(PROMPT) - 1 :]  # [V^2, 3, V]
    probs = (logits / TEMPERATURE).softmax(-1).double()
    p0 = probs[0, 0]  # [V]
    p1 = probs[:, 1].reshape(VOCAB, VOCAB, VOCAB)[:, 0]  # [t0, t1]: row t0*V + x, any x
    p2 = probs[:, 2].reshape(VOCAB, VOCAB, VOCAB)  # [t0, t1, t2]
    joint = p0[:, None, None] * p1[:, :, None] * p2
    return joint.flatten().numpy()


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model_vocab_5"])
def test_first_tokens_follow_the_target_distribution(models, method):
    target, draft = models
    spec = {"method": method, "num_speculative_tokens": 2, "acceptance_backoff": False}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=2)
    else:
        spec.update(method="draft_model", model=str(draft))
        if method == "draft_model_vocab_5":  # q = 0 on ids 5..7: the target's still exact
            spec["draft_vocab_size"] = 5
    llm = make_llm(target, max_num_seqs=256, speculative_config=spec)
    params = [
        SamplingParams(temperature=TEMPERATURE, seed=i, max_tokens=NUM_TOKENS + 1, ignore_eos=True)
        for i in range(N)
    ]
    outs = generate(llm, [PROMPT] * N, params)
    m = metrics(llm)
    accepted = m["impasto:spec_decode_num_accepted_tokens"]
    drafted = m["impasto:spec_decode_num_draft_tokens"]
    # Both paths ran: accepted drafts and rejected ones (then a residual sample).
    assert drafted > N / 2 and 0.1 * drafted < accepted < 0.9 * drafted
    codes = [(o[0] * VOCAB + o[1]) * VOCAB + o[2] for o in outs]
    counts = np.bincount(codes, minlength=VOCAB**NUM_TOKENS)
    p = exact_joint(target)
    assert tv(counts, p) < tv_threshold(p, N)
    # The per-position marginals are much sharper tests of the verified positions 1 and 2.
    cube, p_cube = counts.reshape((VOCAB,) * 3), p.reshape((VOCAB,) * 3)
    for axes in ((0, 2), (0, 1)):
        marginal = p_cube.sum(axis=axes)
        assert tv(cube.sum(axis=axes), marginal) < tv_threshold(marginal, N), axes
    # Per-request seeds: the same request gives the same tokens, whatever the batch.
    again = generate(llm, [PROMPT] * 3, params[5:8])
    assert again == outs[5:8]
