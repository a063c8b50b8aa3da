"""Unmasking for masked block diffusion: candidates for the masked slots of a block, and the
registry of rules that choose which of them a step commits.

One step of one block, on the logits of its masked slots `[m, V]` (float32):

1. candidates (`propose`): greedy (temperature 0) takes the argmax; otherwise the logits are
   divided by the temperature, filtered by top-k / top-p, and one token is drawn per slot by
   inverse CDF at a uniform seeded by (request seed, absolute position, block step) — so a
   request's output does not depend on batch composition, preemption or prefix caching.
   A candidate's confidence is its probability under the tempered, unfiltered distribution
   (SDAR's evaluation code, JetEngine, SGLang's argmax rule at temperature 0); its entropy is
   that distribution's. The mask token itself is never a candidate (its logit is -inf), so a
   committed slot is never a mask again;
2. a rule from `RULES` picks the slots to commit (at least one per step, always);
3. at the step cap every slot left is committed.

Rules (the names of `UnmaskingParams.algorithm`):
- `low_confidence`: every slot with confidence > threshold, at least the most confident one;
- `top_k`: the `k_per_step` most confident slots;
- `entropy_bounded`: the lowest-entropy slots while sum(entropy) - max(entropy) <= bound;
- `random`: `k_per_step` slots drawn uniformly (seeded like the candidates).
Ties in confidence go to the leftmost slot (stable sort), as in the reference decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from impasto.config.block_diffusion import UnmaskingParams
from impasto.worker.diffusion.sampler import categorical, entropy_bound_accept, mix_seed
from impasto.worker.sampling_ops import apply_top_k_top_p

STREAM_CANDIDATE, STREAM_RANDOM_ORDER = 11, 12


def uniform(seed: int, position: int, step: int, stream: int) -> float:
    g = torch.Generator()
    g.manual_seed(mix_seed(seed, position, step, stream))
    return float(torch.rand((), generator=g))


@dataclass
class Candidates:
    tokens: torch.Tensor  # [m] int64
    confidence: torch.Tensor  # [m] float32
    entropy: torch.Tensor  # [m] float32


def propose(
    logits: torch.Tensor,  # [m, V] float32, the mask token already at -inf
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    positions: list[int],  # [m] absolute positions of the slots
    step: int,
) -> Candidates:
    if temperature < 1e-5:  # greedy
        logp = torch.log_softmax(logits, dim=-1)
        best, tokens = logp.max(dim=-1)
        ent = -(logp.exp() * logp).nan_to_num_(0.0).sum(-1)
        return Candidates(tokens, best.exp(), ent)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    m = logits.shape[0]
    k = torch.full((m,), top_k, dtype=torch.int64) if top_k > 0 else None
    p = torch.full((m,), top_p) if top_p < 1.0 else None
    probs = torch.softmax(apply_top_k_top_p(scaled, k, p), dim=-1)
    u = torch.tensor([uniform(seed, pos, step, STREAM_CANDIDATE) for pos in positions])
    tokens = categorical(probs, u)
    conf = logp.gather(1, tokens[:, None]).squeeze(1).exp()
    ent = -(logp.exp() * logp).nan_to_num_(0.0).sum(-1)
    return Candidates(tokens, conf, ent)


Rule = Callable[[Candidates, UnmaskingParams, list[int], int, int], torch.Tensor]


def _top(score: torch.Tensor, k: int) -> torch.Tensor:
    """bool [m]: the k highest scores, ties to the leftmost."""
    order = torch.sort(score, descending=True, stable=True).indices[:k]
    return torch.zeros_like(score, dtype=torch.bool).index_fill_(0, order, True)


def low_confidence(c: Candidates, p: UnmaskingParams, pos: list[int], seed: int, step: int):
    keep = c.confidence > p.threshold
    return keep if bool(keep.any()) else _top(c.confidence, 1)


def top_k(c: Candidates, p: UnmaskingParams, pos: list[int], seed: int, step: int):
    return _top(c.confidence, p.k_per_step)


def entropy_bounded(c: Candidates, p: UnmaskingParams, pos: list[int], seed: int, step: int):
    keep = entropy_bound_accept(c.entropy, p.entropy_bound)
    return keep if bool(keep.any()) else _top(-c.entropy, 1)


def random_order(c: Candidates, p: UnmaskingParams, pos: list[int], seed: int, step: int):
    score = torch.tensor([uniform(seed, q, step, STREAM_RANDOM_ORDER) for q in pos])
    return _top(score, p.k_per_step)


RULES: dict[str, Rule] = {
    "low_confidence": low_confidence,
    "top_k": top_k,
    "entropy_bounded": entropy_bounded,
    "random": random_order,
}


def register_rule(name: str, rule: Rule) -> None:
    """Add an unmasking rule under `name` (it must also be accepted by `UnmaskingParams`)."""
    RULES[name] = rule


def choose(
    c: Candidates,
    params: UnmaskingParams,
    positions: list[int],
    seed: int,
    step: int,
    last_step: bool,
    forced: int | None = None,
) -> torch.Tensor:
    """bool [m]: the slots this step commits. `forced`: a slot committed whatever the rule
    (token shift: the block's first slot is the AR next token of the finished prefix)."""
    if last_step:
        return torch.ones_like(c.confidence, dtype=torch.bool)
    keep = RULES[params.algorithm](c, params, positions, seed, step)
    if forced is not None:
        keep[forced] = True
    return keep
