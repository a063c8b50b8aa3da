"""Engine-level speculation: config validation, counters that add up, draft/target caches kept
in step through preemption and abort (no leaked blocks), sampling features under speculation."""

from __future__ import annotations

import random

import pytest

from impasto import SamplingParams
from impasto.config.speculative import SpeculativeConfig
from tests.entrypoints.conftest import build_checkpoint

from .conftest import generate, make_llm, metrics
from .test_spec_greedy_equivalence import GREEDY, prompts

NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.mark.parametrize(
    "raw, match",
    [
        (dict(method="ngram"), "num_speculative_tokens"),
        (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(method="ngram", num_speculative_tokens=2.5), "num_speculative_tokens"),
        (dict(method="medusa", num_speculative_tokens=2), "method"),
        (dict(method="draft_model", num_speculative_tokens=2), "model"),
        (dict(NGRAM, prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup"),
        (dict(NGRAM, typo=1), "unknown key"),
        (dict(NGRAM, draft_tensor_parallel_size=2), "draft_tensor_parallel_size"),
        (dict(NGRAM, disable_by_batch_size=1), "disable_by_batch_size"),
        (dict(NGRAM, draft_vocab_size=64), "draft_vocab_size only applies"),
        (dict(model="/x", num_speculative_tokens=2, draft_vocab_size=0), "draft_vocab_size"),
        (dict(model="/x", num_speculative_tokens=2, draft_vocab_size=6.5), "draft_vocab_size"),
        ([1, 2], "must be a dict"),
    ],
)
def test_bad_configs_are_refused(raw, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(raw)


def test_config_defaults_and_aliases():
    legacy = SpeculativeConfig.from_dict({"model": "ngram", "num_speculative_tokens": 2})
    assert (legacy.method, legacy.prompt_lookup_min, legacy.prompt_lookup_max) == ("ngram", 5, 5)
    one = SpeculativeConfig.from_dict(
        dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
    )
    assert (one.prompt_lookup_min, one.prompt_lookup_max, one.num_lookahead_tokens) == (3, 3, 0)
    draft = SpeculativeConfig.from_dict({"model": "/x", "num_speculative_tokens": 4})
    assert draft.uses_draft_model and draft.num_lookahead_tokens == 4


def test_engine_refuses_bad_combinations(tiny_llama, tmp_path):
    other_vocab = build_checkpoint(tmp_path / "v8", "llama", vocab_size=8, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(
            tiny_llama, speculative_config=dict(model=str(other_vocab), num_speculative_tokens=2)
        )
    too_many = dict(model=str(tiny_llama), num_speculative_tokens=2, draft_vocab_size=10**6)
    with pytest.raises(ValueError, match="draft_vocab_size .* exceeds"):
        make_llm(tiny_llama, speculative_config=too_many)
    with pytest.raises(ValueError, match="diffusion"):
        make_llm(tiny_llama, speculative_config=NGRAM, diffusion_config={"canvas_length": 16})


def test_counters_add_up(tiny_llama):
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    runner = llm.llm_engine.runner
    decode_events = []
    execute = runner.execute_model

    def spy(so):
        out = execute(so)
        decode_events.extend(1 for toks in out.sampled_token_ids if toks)
        return out

    runner.execute_model = spy
    outs = generate(llm, prompts(), GREEDY)
    m = metrics(llm)
    drafts = m["impasto:spec_decode_num_drafts"]
    drafted = m["impasto:spec_decode_num_draft_tokens"]
    accepted = m["impasto:spec_decode_num_accepted_tokens"]
    per_pos = [m[f"impasto:spec_decode_num_accepted_tokens_per_pos[{i}]"] for i in range(3)]
    assert 0 < accepted <= drafted <= 3 * drafts
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert per_pos[0] <= drafts
    assert m["impasto:spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert m["impasto:spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    # Every sampling step commits 1 token plus its accepted drafts (drafts never overrun
    # max_tokens, so nothing is trimmed).
    generated = sum(len(o) for o in outs)
    assert generated == m["impasto:generation_tokens"] == len(decode_events) + accepted


def test_draft_cache_consistent_through_preemption_and_abort(tiny_llama):
    """The target as its own draft: any stale or missing draft KV would show as a rejection."""
    spec = dict(model=str(tiny_llama), num_speculative_tokens=3, acceptance_backoff=False)
    kwargs = dict(enable_prefix_caching=True, num_gpu_blocks_override=20, max_model_len=64)
    ps = prompts()
    expected = generate(make_llm(tiny_llama, **kwargs), ps, GREEDY)
    llm = make_llm(tiny_llama, speculative_config=spec, **kwargs)
    engine = llm.llm_engine
    for i, p in enumerate(ps):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    engine.add_request("doomed", {"prompt_token_ids": ps[0][:9]}, GREEDY)
    done: dict[str, list[int]] = {}
    produced: dict[str, list[int]] = {}  # the engine's outputs are deltas: concatenate them
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = produced[out.request_id]
        steps += 1
        if steps == 6:
            engine.abort_request("doomed")
    assert [done[str(i)] for i in range(len(ps))] == expected
    m = metrics(llm)
    assert m["impasto:num_preemptions"] > 0
    assert m["impasto:spec_decode_num_accepted_tokens"] == m["impasto:spec_decode_num_draft_tokens"]
    kv = engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert not kv.req_to_blocks and kv.num_free_blocks == 20 - 1  # every block came back
    engine.step()  # delivers the finished ids to the runner
    assert not engine.runner.requests and engine.runner.batch.num_reqs == 0


def test_sampling_features_under_speculation(tiny_llama):
    """Params vLLM refuses with speculation (min_p, logit_bias) and penalties, min_tokens and
    logprobs all act on every verified position: same tokens and logprobs as without."""
    rng = random.Random(3)
    ps = prompts()[:4]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        min_tokens=4,
        logit_bias={rng.randrange(160): 5.0, rng.randrange(160): -100.0},
        min_p=0.1,
        repetition_penalty=1.3,
        frequency_penalty=0.2,
        logprobs=2,
        stop_token_ids=[7],
    )
    llms = [make_llm(tiny_llama), make_llm(tiny_llama, speculative_config=NGRAM)]
    runs = [
        llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False) for llm in llms
    ]
    for base, spec in zip(*runs, strict=True):
        a, b = base.outputs[0], spec.outputs[0]
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
    assert metrics(llms[1])["impasto:spec_decode_num_draft_tokens"] > 0


def test_seeded_sampling_with_ngram_is_the_plain_seeded_sample(tiny_llama):
    """Deterministic drafts are verified with the plain sampler's own noise: a seeded request
    commits exactly the tokens it commits without speculation, whatever the batch."""
    ps = prompts()
    params = [
        SamplingParams(temperature=0.1, top_p=0.95, seed=100 + i, max_tokens=16, ignore_eos=True)
        for i in range(len(ps))
    ]
    expected = generate(make_llm(tiny_llama), ps, params)
    llm = make_llm(tiny_llama, speculative_config=dict(NGRAM, acceptance_backoff=False))
    assert generate(llm, ps, params) == expected
    m = metrics(llm)
    assert m["impasto:spec_decode_num_accepted_tokens"] > 0
    assert generate(llm, ps[:1], params[:1]) == expected[:1]
