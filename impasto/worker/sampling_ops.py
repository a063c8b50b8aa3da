"""Pure tensor ops of the sampler: penalties, bias, masks, noise, logprobs.

All ops are row-wise: row i of the result depends only on row i of the inputs, so a request's
sample never depends on which other requests share the batch. Masked logits are `-inf`.
No op loops over the vocabulary in Python; loops are over rows or over bias entries only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

_MASK64 = (1 << 64) - 1


def pad_token_ids(rows: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """Ragged id lists -> `[N, max_len]` int64 padded with -1 (max_len >= 1)."""
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out.to(device)


def token_counts(padded_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[N, L]` ids padded with -1 -> `[N, V]` float32 occurrence counts."""
    n = padded_ids.shape[0]
    # Padding goes to an extra bin V that is dropped afterwards.
    ids = torch.where(padded_ids < 0, vocab_size, padded_ids)
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=padded_ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM/OpenAI penalties. logits, output_counts, prompt_mask: [N, V]; penalties: [N].

    Repetition (over prompt + output tokens): positive logits divided by the penalty, negative
    ones multiplied. Then frequency (times the count) and presence (once) over output tokens.
    """
    seen = output_counts > 0  # [N, V]
    if prompt_mask is not None:
        seen = seen | prompt_mask
    rep = repetition.unsqueeze(1)  # [N, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def apply_logit_bias(
    logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None]
) -> torch.Tensor:
    """Add per-row `{token_id: bias}`; ids must be < V (checked at admission)."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, bias in enumerate(biases):
        if bias:
            rows.extend([i] * len(bias))
            cols.extend(bias.keys())
            vals.extend(float(v) for v in bias.values())
    if not rows:
        return logits
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    values = torch.tensor(vals, dtype=logits.dtype, device=dev)
    return logits.index_put(index, values, accumulate=True)


def apply_banned_tokens(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set `banned[i]` ids of row i to -inf (min_tokens: stop ids not yet allowed)."""
    rows = [i for i, ids in enumerate(banned) for _ in ids]
    if not rows:
        return logits
    cols = [t for ids in banned for t in ids]
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    return logits.index_put(index, torch.tensor(float("-inf"), device=dev))


def apply_allowed_tokens(
    logits: torch.Tensor, allowed: Sequence[Sequence[int] | None]
) -> torch.Tensor:
    """Rows with an `allowed[i]` list keep only those ids (every other logit -inf); rows with
    None are unchanged. Ids must be < V (checked at admission)."""
    rows = [i for i, ids in enumerate(allowed) if ids is not None for _ in ids]
    if not rows:
        return logits
    cols = [t for ids in allowed if ids is not None for t in ids]
    dev = logits.device
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = True
    restricted = torch.tensor([ids is not None for ids in allowed], device=dev).unsqueeze(1)
    return logits.masked_fill(restricted & ~keep, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob. Done in logit space: logit < max + log(min_p).

    min_p: [N]; 0 disables (log 0 = -inf masks nothing).
    """
    top = logits.max(dim=-1, keepdim=True).values  # [N, 1]
    threshold = top + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """top-k then top-p, vLLM semantics. top_k: [N] int (0 or >= V disables); top_p: [N] (1 off).

    top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept).
    top-p keeps the smallest set of most likely tokens whose mass reaches p (renormalised after
    top-k): a token is dropped when the mass strictly before it, in descending order, is >= p.
    The most likely token is always kept.
    """
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    if top_p is None:
        if top_k is None:
            return logits
        # top-k only: a partial top-k is cheaper than a full sort.
        max_k = int(k.max().item())
        values = logits.topk(max_k, dim=-1).values  # [N, max_k], descending
        kth = values.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
        return logits.masked_fill(logits < kth, float("-inf"))

    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [N, V]
    if top_k is not None:
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [N, V], exclusive prefix sums
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, position: int, stream: int = 0) -> int:
    """A 64-bit generator seed that is a function of (request seed, token position, stream) only.

    `stream` separates independent draws at the same position (e.g. rejection-sampling uniforms,
    diffusion denoise steps) so that they do not reuse the sampling noise.
    """
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (position & _MASK64))
    return _splitmix64(h ^ (stream & _MASK64))


def exponential_noise(
    shape: tuple[int, ...],  # (N, V)
    seeds: Sequence[int | None],
    positions: Sequence[int],
    generator: torch.Generator | None,
    device: torch.device,
    stream: int = 0,
) -> torch.Tensor:
    """`[N, V]` i.i.d. Exp(1) noise, clamped away from 0.

    Seeded rows: drawn from a fresh generator seeded with derive_seed(seed, position, stream), so
    the row is the same whatever the batch. Unseeded rows: one vectorised draw from `generator`
    (the runner's, seeded from the engine seed; it must live on `device`).
    """
    n, vocab = shape
    q = torch.empty(shape, dtype=torch.float32, device=device)
    seeded = [i for i, s in enumerate(seeds) if s is not None]
    if len(seeded) < n:
        if not seeded:
            q.exponential_(generator=generator)
        else:
            unseeded = [i for i, s in enumerate(seeds) if s is None]
            draw = torch.empty((len(unseeded), vocab), dtype=torch.float32, device=device)
            q[torch.tensor(unseeded, device=device)] = draw.exponential_(generator=generator)
    for i in seeded:
        g = torch.Generator(device=device)
        g.manual_seed(derive_seed(seeds[i], positions[i], stream))  # type: ignore[arg-type]
        q[i].exponential_(generator=g)
    # Exp(1) can return exactly 0; 0/0 would be NaN and win the argmax.
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


def sample_from_probs(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Categorical sample per row: argmax(p / E) with E ~ Exp(1) (exponential race). [N]."""
    return (probs / noise).argmax(dim=-1)


def topk_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From `[N, V]` logprobs and chosen ids `[N]`: (chosen logprob [N], 1-based rank [N],
    top ids [N, K], top logprobs [N, K]). rank = 1 + number of strictly larger logprobs."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    num_top = min(num_top, logprobs.shape[-1])
    top_vals, top_ids = logprobs.topk(num_top, dim=-1)  # [N, K]
    return chosen.squeeze(1), ranks, top_ids, top_vals


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows, V] -> [rows] bool: the rows holding no NaN / inf. Read through each row's sum (a
    NaN or inf anywhere makes it non-finite; finite logits are far too small to overflow it):
    one reduction, tens of times cheaper than `isfinite(logits).all(-1)`, which writes a
    [rows, V] mask first."""
    return torch.isfinite(logits.sum(dim=-1))
