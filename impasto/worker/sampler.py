"""The AR sampler: logits `[N, V]` of the rows that need a token -> one token id per row.

A row is one sampling position. Today that is one row per AR request; speculative verification
will pass `1 + K` rows per request, each with its own `positions` / `output_token_ids` entry.

Order of processing (vLLM's): raw logprobs (if asked) -> allowed ids, logit bias, banned ids
(min_tokens, bad words), penalties -> greedy argmax | temperature -> min-p -> top-k -> top-p ->
exponential-race sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from impasto.sampling_params import _GREEDY_EPS, SamplingParams
from impasto.worker import sampling_ops as ops


@dataclass
class SamplingMetadata:
    """Sampling inputs of one step, row-aligned with the logits (N rows). Built by the runner
    (see `from_params`). Optional tensors are None when no row uses the feature, so that the
    common batch skips the work."""

    temperature: torch.Tensor | None  # [N] float32; 0.0 marks a greedy row; None iff all_greedy
    all_greedy: bool  # every row greedy: pure argmax, no noise drawn
    all_random: bool  # no row greedy: no argmax / select
    top_k: torch.Tensor | None  # [N] int64; 0 = off
    top_p: torch.Tensor | None  # [N] float32; 1.0 = off
    min_p: torch.Tensor | None  # [N] float32; 0.0 = off
    # The three penalty tensors are all set or all None.
    presence_penalties: torch.Tensor | None  # [N] float32; 0.0 = off
    frequency_penalties: torch.Tensor | None  # [N] float32; 0.0 = off
    repetition_penalties: torch.Tensor | None  # [N] float32; 1.0 = off
    output_token_ids: Sequence[Sequence[int]]  # [N] ragged: generated before this row's token
    prompt_token_ids: torch.Tensor | None  # [N, P] int64 padded with -1; repetition penalty only
    logit_bias: list[dict[int, float] | None] | None  # [N]
    banned_token_ids: list[list[int]] | None  # [N]; ids forced to -inf (min_tokens, bad words)
    allowed_token_ids: list[list[int] | None] | None  # [N]; None row: every id allowed
    seeds: list[int | None]  # [N]; None: draw from `generator`
    positions: list[int]  # [N] sequence position of the token this row samples
    generator: torch.Generator | None  # runner-owned, seeded from the engine seed; on the device
    max_num_logprobs: int | None  # None: no logprobs; -1: whole vocab; else top-K for all rows

    @property
    def no_penalties(self) -> bool:
        return self.presence_penalties is None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        positions: Sequence[int],
        device: torch.device | str,
        generator: torch.Generator | None = None,
    ) -> SamplingMetadata:
        """One entry per row in every sequence argument (repeat a request's params for its rows).

        positions[i] = index in the request's full sequence (prompt + output) of the token row i
        samples, i.e. `len(prompt) + len(output_token_ids[i])` for a plain AR row. It is what
        makes seeded sampling independent of batching and preemption.
        """
        greedy = [p.is_greedy for p in params]

        def vec(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        all_greedy = all(greedy)
        temps = [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        use_k = any(p.top_k > 0 for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        use_pen = any(p.has_penalties for p in params)
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        banned = [_banned_ids(p, out) for p, out in zip(params, output_token_ids, strict=True)]
        allowed = [p.allowed_token_ids for p in params]
        max_lp = [p.logprobs for p in params if p.logprobs is not None]
        biases = [p.logit_bias_ids for p in params]
        return cls(
            temperature=None if all_greedy else vec(temps),
            all_greedy=all_greedy,
            all_random=not any(greedy),
            top_k=vec([p.top_k for p in params], torch.int64) if use_k else None,
            top_p=vec([p.top_p for p in params]) if use_p else None,
            min_p=vec([p.min_p for p in params]) if use_min_p else None,
            presence_penalties=vec([p.presence_penalty for p in params]) if use_pen else None,
            frequency_penalties=vec([p.frequency_penalty for p in params]) if use_pen else None,
            repetition_penalties=vec([p.repetition_penalty for p in params]) if use_pen else None,
            output_token_ids=output_token_ids,  # not copied: read only when penalties are on
            prompt_token_ids=ops.pad_token_ids(prompt_token_ids, device) if use_rep else None,
            logit_bias=biases if any(biases) else None,
            banned_token_ids=banned if any(banned) else None,
            allowed_token_ids=allowed if any(a is not None for a in allowed) else None,
            seeds=[p.seed for p in params],
            positions=list(positions),
            generator=generator,
            max_num_logprobs=(-1 if -1 in max_lp else max(max_lp)) if max_lp else None,
        )


def _banned_ids(params: SamplingParams, output: Sequence[int]) -> list[int]:
    """Ids this row may not sample, given the tokens generated before it (`output`, drafts
    included on verification rows): stop ids (and EOS unless ignore_eos) until min_tokens are
    generated; the last token of every bad word whose other tokens end the output."""
    ids: set[int] = set()
    if len(output) < params.min_tokens:
        ids |= params.all_stop_token_ids
        if params.eos_token_id is not None and not params.ignore_eos:
            ids.add(params.eos_token_id)
    for word in params.bad_words_token_ids or ():
        *head, last = word
        if not head or (len(output) >= len(head) and list(output[-len(head) :]) == head):
            ids.add(last)
    return sorted(ids)


@dataclass
class LogprobsTensors:
    """Logprobs of N positions: the chosen token (sampled, or the next prompt token) and the
    top-K of the vocabulary. Values are log_softmax of the raw logits."""

    token_ids: torch.Tensor  # [N] int64, the chosen tokens
    logprobs: torch.Tensor  # [N] float32
    ranks: torch.Tensor  # [N] int64, 1-based rank of the chosen token
    topk_token_ids: torch.Tensor  # [N, K] int64, descending logprob
    topk_logprobs: torch.Tensor  # [N, K] float32

    def to_dicts(self, num_top: Sequence[int] | None = None) -> list[dict[int, tuple[float, int]]]:
        """Per row `{token_id: (logprob, rank)}`: the chosen token first, then the top
        `num_top[i]` tokens (ranks 1..k). One host transfer for the whole batch."""
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        top_ids, top_lps = self.topk_token_ids.tolist(), self.topk_logprobs.tolist()
        rows: list[dict[int, tuple[float, int]]] = []
        for i in range(len(ids)):
            k = len(top_ids[i]) if num_top is None or num_top[i] < 0 else num_top[i]
            row = {ids[i]: (lps[i], ranks[i])}
            for r, (t, lp) in enumerate(zip(top_ids[i][:k], top_lps[i][:k], strict=True)):
                row.setdefault(t, (lp, r + 1))
            rows.append(row)
        return rows


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None  # set iff metadata.max_num_logprobs is not None


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> LogprobsTensors:
    """`[N, V]` logprobs, chosen ids `[N]` -> LogprobsTensors; num_top -1 = whole vocab."""
    k = logprobs.shape[-1] if num_top < 0 else num_top
    chosen, ranks, top_ids, top_lps = ops.topk_logprobs(logprobs, token_ids, k)
    return LogprobsTensors(token_ids, chosen, ranks, top_ids, top_lps)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_top: int, chunk: int = 1024
) -> LogprobsTensors:
    """prompt_logprobs: logits `[P, V]` at prompt positions 0..P-1 and the prompt tokens that
    follow them `[P]` -> logprob/rank of each next token and the top-`num_top`. Chunked over P so
    the fp32 log_softmax never holds more than `chunk` rows."""
    parts = [
        gather_logprobs(
            logits[s : s + chunk].float().log_softmax(dim=-1),
            next_token_ids[s : s + chunk],
            num_top,
        )
        for s in range(0, logits.shape[0], chunk)
    ]
    if len(parts) == 1:
        return parts[0]
    fields = ("token_ids", "logprobs", "ranks", "topk_token_ids", "topk_logprobs")
    return LogprobsTensors(*(torch.cat([getattr(p, f) for p in parts]) for f in fields))


class Sampler:
    """Stateless; all per-request state arrives in SamplingMetadata."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        # vLLM's default "raw logprobs": before penalties, bias, temperature and truncation.
        raw = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.apply_logits_processors(logits, meta)
        sampled = self.sample(logits, meta)
        lp = None if raw is None else gather_logprobs(raw, sampled, meta.max_num_logprobs or 0)
        return SamplerOutput(sampled, lp)

    def apply_logits_processors(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Processors that can change the argmax: allowed ids, bias, banned ids, penalties.
        Out of place."""
        if meta.allowed_token_ids is not None:
            logits = ops.apply_allowed_tokens(logits, meta.allowed_token_ids)
        if meta.logit_bias is not None:
            logits = ops.apply_logit_bias(logits, meta.logit_bias)
        if meta.banned_token_ids is not None:
            logits = ops.apply_banned_tokens(logits, meta.banned_token_ids)
        if meta.presence_penalties is not None:
            assert meta.frequency_penalties is not None and meta.repetition_penalties is not None
            vocab = logits.shape[-1]
            counts = ops.token_counts(
                ops.pad_token_ids(meta.output_token_ids, logits.device), vocab
            )
            prompt_mask = None
            if meta.prompt_token_ids is not None:
                prompt_mask = ops.token_counts(meta.prompt_token_ids, vocab) > 0
            logits = ops.apply_penalties(
                logits,
                counts,
                prompt_mask,
                meta.presence_penalties,
                meta.frequency_penalties,
                meta.repetition_penalties,
            )
        return logits

    def apply_temperature_and_filters(
        self, logits: torch.Tensor, meta: SamplingMetadata
    ) -> torch.Tensor:
        """logits / T, then min-p, top-k, top-p. Greedy rows are divided by 1 (their sample is
        replaced by the argmax anyway). softmax of the result is the sampling distribution."""
        assert meta.temperature is not None
        temp = torch.where(meta.temperature < _GREEDY_EPS, 1.0, meta.temperature)
        logits = logits / temp.unsqueeze(1)
        if meta.min_p is not None:
            logits = ops.apply_min_p(logits, meta.min_p)
        return ops.apply_top_k_top_p(logits, meta.top_k, meta.top_p)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Processed logits `[N, V]` -> token ids `[N]` int64."""
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            assert greedy is not None
            return greedy
        assert meta.temperature is not None
        probs = self.apply_temperature_and_filters(logits, meta).softmax(dim=-1)
        noise = ops.exponential_noise(
            tuple(probs.shape), meta.seeds, meta.positions, meta.generator, probs.device
        )
        sampled = ops.sample_from_probs(probs, noise)
        if greedy is None:
            return sampled
        return torch.where(meta.temperature < _GREEDY_EPS, greedy, sampled)
