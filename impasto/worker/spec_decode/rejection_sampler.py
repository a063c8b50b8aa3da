"""Lossless verification of drafts: the standard speculative-sampling rule.

A request with k drafts has k + 1 logits rows; row j is the target's distribution p_j of the
token after drafts[:j] (processors - bias, banned ids, penalties - already see drafts[:j]).

- greedy rows: draft j is accepted iff it equals argmax p_j; the first mismatch (or row k, the
  bonus) contributes the target's argmax. Identical to decoding without drafts.
- random rows, drawn drafts (a draft model's q_j): draft j is accepted iff
  u_j * q_j(d_j) < p_j(d_j), u_j ~ U[0, 1); at the first rejection the correction is sampled
  from max(p_j - q_j, 0) (normalisation is implicit in the exponential race); if all are
  accepted the bonus is drawn from p_k.
- random rows, deterministic drafts (n-gram, padding: q_j = one-hot(d_j)): the same rule - accept
  with probability p_j(d_j), else sample from p_j without d_j - realised with coupled randomness:
  row j draws x_j ~ p_j with exactly the noise plain sampling would use at that position, and
  d_j is accepted iff x_j == d_j, else x_j is the correction. So a seeded request commits the
  very tokens it would commit without speculation. A -1 placeholder never matches.
The committed tokens are distributed exactly as sampling from the target alone.

Randomness is per row: seeded requests draw u_j and the race noise from generators seeded by
(seed, position, stream), so a request's output does not depend on the batch. The race noise
uses stream 0, the same as the plain sampler: with no drafts the result is the plain sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from impasto.sampling_params import _GREEDY_EPS
from impasto.worker import sampling_ops as ops
from impasto.worker.sampler import Sampler, SamplerOutput, SamplingMetadata, gather_logprobs

ACCEPT_STREAM = 1  # derive_seed stream of the acceptance uniforms
DRAFT_STREAM = 2  # derive_seed stream of a draft model's own samples


def uniform_draws(
    seeds: Sequence[int | None],
    positions: Sequence[int],
    generator: torch.Generator | None,
    device: torch.device,
    stream: int,
) -> torch.Tensor:
    """`[N]` U[0, 1): seeded rows from (seed, position, stream), others from `generator`."""
    u = torch.empty(len(seeds), dtype=torch.float32, device=device)
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    if unseeded:
        draw = torch.rand(len(unseeded), generator=generator, device=device)
        u[torch.tensor(unseeded, device=device)] = draw
    for i, s in enumerate(seeds):
        if s is not None:
            g = torch.Generator(device=device)
            g.manual_seed(ops.derive_seed(s, positions[i], stream))
            u[i] = torch.rand(1, generator=g, device=device)[0]
    return u


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V], N = sum over requests of (k + 1)
        meta: SamplingMetadata,  # N rows
        plan: Sequence[tuple[int, int]],  # per request: (first row, k drafts)
        drafts: Sequence[Sequence[int]],  # per request: k drafts (-1 = placeholder)
        draft_probs: Sequence[torch.Tensor | None],  # per request: [k, V] q, None = one-hot
    ) -> tuple[SamplerOutput, list[int]]:
        """-> (per-row token ids, logprobs of those tokens; accepted drafts per request).
        Row first + j holds the j-th committed token for j <= accepted; later rows are unused."""
        n, vocab = logits.shape
        dev = logits.device
        logits = logits.float()
        raw = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.sampler.apply_logits_processors(logits, meta)

        # Row-aligned draft ids; -1 on bonus rows and placeholders.
        draft_row = torch.full((n,), -1, dtype=torch.int64)
        for (first, k), d in zip(plan, drafts, strict=True):
            if k:
                draft_row[first : first + k] = torch.tensor(d[:k], dtype=torch.int64)
        draft_row = draft_row.to(dev)
        has_draft = draft_row >= 0
        safe = draft_row.clamp_min(0).unsqueeze(1)  # [N, 1]

        greedy = None if meta.all_random else logits.argmax(dim=-1)  # [N]
        if meta.all_greedy:
            assert greedy is not None
            accept, tokens = has_draft & (draft_row == greedy), greedy
        else:
            assert meta.temperature is not None
            probs = self.sampler.apply_temperature_and_filters(logits, meta).softmax(dim=-1)
            p_draft = probs.gather(1, safe).squeeze(1) * has_draft  # [N]; 0 for placeholders
            q_draft = torch.ones(n, device=dev)
            drawn = torch.zeros(n, dtype=torch.bool)  # rows verifying a draft model's draft
            residual = probs.clone()  # one-hot q (coupled rule): sample from p itself
            for (first, k), q in zip(plan, draft_probs, strict=True):
                if q is not None and k:  # a drawn draft: q is its full distribution
                    q = q[:k].to(dev)
                    rows = slice(first, first + k)
                    q_draft[rows] = q.gather(1, safe[rows]).squeeze(1)
                    residual[rows] = (probs[rows] - q).clamp_min(0.0)
                    drawn[rows] = True
            drawn = drawn.to(dev) & has_draft
            residual = torch.where(drawn.unsqueeze(1), residual, probs)
            # p == q exactly leaves no residual (and no rejection is possible): fall back to p.
            empty = residual.sum(dim=-1, keepdim=True) <= 0
            residual = torch.where(empty, probs, residual)
            u = q_draft  # unused unless a draft model drew some drafts
            if bool(drawn.any()):
                u = uniform_draws(meta.seeds, meta.positions, meta.generator, dev, ACCEPT_STREAM)
            noise = ops.exponential_noise(
                (n, vocab), meta.seeds, meta.positions, meta.generator, dev
            )
            tokens = ops.sample_from_probs(residual, noise)
            accept = torch.where(drawn, u * q_draft < p_draft, has_draft & (tokens == draft_row))
            if greedy is not None:
                is_greedy = meta.temperature < _GREEDY_EPS
                tokens = torch.where(is_greedy, greedy, tokens)
                accept = torch.where(is_greedy, has_draft & (draft_row == greedy), accept)

        accept_l = accept.tolist()
        num_accepted = []
        for first, k in plan:
            a = 0
            while a < k and accept_l[first + a]:
                a += 1
            num_accepted.append(a)
        # Committed token j of a request: its draft if accepted, else the row's own token.
        out = torch.where(accept, draft_row, tokens)
        lp = None if raw is None else gather_logprobs(raw, out, meta.max_num_logprobs or 0)
        return SamplerOutput(out, lp), num_accepted
