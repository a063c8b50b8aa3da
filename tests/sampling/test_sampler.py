"""The Sampler end to end: greedy exactness, seeds, distributions, logprobs."""

from __future__ import annotations

import torch

from impasto.sampling_params import SamplingParams
from impasto.worker.sampler import (
    Sampler,
    SamplingMetadata,
    compute_prompt_logprobs,
    gather_logprobs,
)

V = 32


def make_meta(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    positions: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> SamplingMetadata:
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[1, 2, 3] for _ in range(n)]
    if positions is None:
        positions = [len(p) + len(o) for p, o in zip(prompts, outputs, strict=True)]
    return SamplingMetadata.from_params(params, outputs, prompts, positions, "cpu", generator)


def test_metadata_flags_and_optional_tensors() -> None:
    meta = make_meta([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=5)])
    assert meta.all_greedy and not meta.all_random and meta.temperature is None
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None  # greedy normalised
    assert meta.no_penalties and meta.prompt_token_ids is None and meta.max_num_logprobs is None
    meta = make_meta(
        [SamplingParams(top_p=0.5, logprobs=3), SamplingParams(repetition_penalty=1.2, logprobs=-1)]
    )
    assert meta.all_random and not meta.all_greedy
    assert meta.top_p is not None and meta.top_p.tolist() == [0.5, 1.0]
    assert meta.repetition_penalties is not None and meta.prompt_token_ids is not None
    assert meta.max_num_logprobs == -1


def test_greedy_is_exact_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, V)
    out = Sampler()(logits, make_meta([SamplingParams(temperature=0.0)] * 16))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


def test_greedy_rows_in_mixed_batch_and_after_penalties() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
    ]
    top = logits.argmax(dim=-1).tolist()
    outputs = [[], [], [top[2]] * 3, [], [], []]
    prompts = [[1], [1], [1], [1], [1], [top[5]]]
    gen = torch.Generator().manual_seed(0)
    sampled = Sampler()(logits, make_meta(params, outputs, prompts, generator=gen))
    got = sampled.sampled_token_ids.tolist()
    assert got[0] == top[0] and got[4] == 5
    pen = logits[2].clone()
    pen[top[2]] -= 2.0 + 3 * 1.0
    assert got[2] == int(pen.argmax())
    rep = logits[5].clone()
    rep[top[5]] = rep[top[5]] / 2 if rep[top[5]] > 0 else rep[top[5]] * 2
    assert got[5] == int(rep.argmax())


def test_min_tokens_bans_stop_ids_until_reached() -> None:
    logits = torch.zeros(2, V)
    logits[:, 7] = 10.0  # EOS is the argmax
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9])
    p.update_from_tokenizer(None, eos_token_id=7, extra_stop_ids=set())
    meta = make_meta([p, p], outputs=[[4], [4, 4]])
    assert meta.banned_token_ids == [[7, 9], []]
    assert Sampler()(logits, meta).sampled_token_ids.tolist()[1] == 7
    assert Sampler()(logits, meta).sampled_token_ids.tolist()[0] != 7


def test_seeded_sampling_independent_of_batch_and_order() -> None:
    torch.manual_seed(2)
    row_a, row_b, other = torch.randn(V), torch.randn(V), torch.randn(5, V)
    pa = SamplingParams(temperature=1.3, top_p=0.9, seed=1234)
    pb = SamplingParams(temperature=0.7, top_k=10, seed=99)
    rand = SamplingParams(temperature=1.0, min_p=0.05)
    sampler = Sampler()
    for pos in range(20):
        alone = sampler(row_a[None], make_meta([pa], positions=[pos])).sampled_token_ids.item()
        batch = torch.stack([other[0], row_b, other[1], row_a, other[2]])
        meta = make_meta(
            [rand, pb, rand, pa, rand],
            positions=[3, pos, 8, pos, 1],
            generator=torch.Generator().manual_seed(pos),
        )
        mixed = sampler(batch, meta).sampled_token_ids.tolist()
        swapped = sampler(
            torch.stack([row_a, row_b]), make_meta([pa, pb], positions=[pos, pos])
        ).sampled_token_ids.tolist()
        b_alone = sampler(row_b[None], make_meta([pb], positions=[pos])).sampled_token_ids.item()
        assert mixed[3] == alone == swapped[0]
        assert mixed[1] == b_alone == swapped[1]
    # Different positions draw different tokens (not a constant argmax).
    draws = {
        sampler(row_a[None], make_meta([pa], positions=[p])).sampled_token_ids.item()
        for p in range(40)
    }
    assert len(draws) > 3


def test_unseeded_deterministic_for_fixed_generator_seed() -> None:
    logits = torch.randn(8, V)
    params = [SamplingParams(temperature=1.0)] * 8

    def run() -> list[int]:
        gen = torch.Generator().manual_seed(42)
        return Sampler()(logits, make_meta(params, generator=gen)).sampled_token_ids.tolist()

    assert run() == run()


def _empirical(samples: torch.Tensor, n: int) -> torch.Tensor:
    return torch.bincount(samples, minlength=n).double() / samples.numel()


def test_temperature_sampling_matches_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    temp = 0.8
    n = 40_000
    gen = torch.Generator().manual_seed(123)
    meta = make_meta([SamplingParams(temperature=temp)] * n, generator=gen)
    got = Sampler()(logits.expand(n, -1), meta).sampled_token_ids
    expected = (logits / temp).softmax(-1).double()
    freq = _empirical(got, 8)
    chi2 = (((freq - expected) ** 2) / expected).sum().item() * n
    assert chi2 < 24.3  # chi-square, 7 dof, p = 0.001
    assert 0.5 * (freq - expected).abs().sum().item() < 0.01


def test_seeded_rows_follow_the_distribution_too() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 6_000
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    got = Sampler()(logits.expand(n, -1), make_meta(params)).sampled_token_ids
    expected = logits.softmax(-1).double()
    assert 0.5 * (_empirical(got, 4) - expected).abs().sum().item() < 0.03


def test_top_k_top_p_min_p_sampling_support_and_renormalisation() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    n = 20_000
    gen = torch.Generator().manual_seed(5)
    for params, support in [
        (SamplingParams(top_k=3), [0, 1, 2]),
        (SamplingParams(top_p=0.8), [0, 1]),  # softmax: .63, .23, .09, ...
        (SamplingParams(min_p=0.3), [0, 1]),  # e^-1 = .37 >= .3 > e^-2
    ]:
        meta = make_meta([params] * n, generator=gen)
        got = Sampler()(logits.expand(n, -1), meta).sampled_token_ids
        freq = _empirical(got, 6)
        expected = torch.zeros(6, dtype=torch.float64)
        expected[support] = logits[support].softmax(-1).double()
        assert 0.5 * (freq - expected).abs().sum().item() < 0.015, params


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=2.0, top_k=3, logprobs=0, seed=1),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.5, logprobs=2),
    ]
    out = Sampler()(
        logits,
        make_meta(params, outputs=[[], [], [0], []], generator=torch.Generator().manual_seed(0)),
    )
    lp = out.logprobs
    assert lp is not None
    ref = logits.log_softmax(-1)
    ids = out.sampled_token_ids
    assert torch.equal(lp.token_ids, ids)
    assert torch.allclose(lp.logprobs, ref.gather(1, ids[:, None]).squeeze(1))
    assert lp.topk_token_ids.shape == (4, 5)
    assert torch.equal(lp.topk_token_ids, ref.topk(5).indices)
    assert torch.allclose(lp.topk_logprobs, ref.topk(5).values)
    order = ref.argsort(dim=-1, descending=True)
    for i in range(4):
        assert lp.ranks[i].item() == (order[i] == ids[i]).nonzero().item() + 1
    assert lp.ranks[0].item() == 1  # greedy picks the top token
    rows = lp.to_dicts([5, 0, 0, 2])
    assert len(rows[1]) == 1 and len(rows[3]) in (2, 3) and len(rows[0]) == 5
    assert rows[0][int(ids[0])] == (lp.logprobs[0].item(), 1)


def test_full_vocab_logprobs_and_prompt_logprobs() -> None:
    torch.manual_seed(4)
    logits = torch.randn(2500, V)
    targets = torch.randint(0, V, (2500,))
    full = gather_logprobs(logits.log_softmax(-1), targets, -1)
    assert full.topk_token_ids.shape == (2500, V)
    chunked = compute_prompt_logprobs(logits, targets, 3, chunk=1000)
    ref = logits.log_softmax(-1)
    assert torch.allclose(chunked.logprobs, ref.gather(1, targets[:, None]).squeeze(1))
    assert torch.equal(chunked.topk_token_ids, ref.topk(3).indices)
    assert torch.equal(chunked.ranks, (ref > chunked.logprobs[:, None]).sum(-1) + 1)
    assert torch.equal(chunked.token_ids, targets)
