"""The AR soak's workload (`soak_ar.py`): random prompts (shared prefixes for prefix-cache hits,
repeated motifs for n-gram drafts, long multi-chunk prefills) and random sampling parameters
over every field `SamplingParams` has, reproducible from one seed, on the tiny word-level
vocabulary of `soak_common.tiny_vocab`."""

from __future__ import annotations

import random
from typing import Any

from soak_common import tiny_vocab

from impasto.sampling_params import SamplingParams

VOCAB = 160
EOS = 2
FIRST_WORD = 3  # ids below are the specials


class Workload:
    """Random prompts and sampling parameters, reproducible from one seed."""

    def __init__(self, rng: random.Random, max_model_len: int) -> None:
        self.rng = rng
        self.max_model_len = max_model_len
        self.words = tiny_vocab(VOCAB)
        self.prefixes = [self._tokens(rng.randrange(8, 49)) for _ in range(6)]
        self.motifs = [self._tokens(rng.randrange(2, 7)) for _ in range(6)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_WORD, VOCAB) for _ in range(n)]

    def prompt(self) -> list[int]:
        rng = self.rng
        kind = rng.random()
        if kind < 0.55:  # a shared prefix (prefix-cache hits) and a random tail
            prompt = rng.choice(self.prefixes) + self._tokens(rng.randrange(0, 25))
        elif kind < 0.75:  # a repeated motif (n-gram drafts find matches)
            motif = rng.choice(self.motifs)
            prompt = motif * rng.randrange(2, 10) + self._tokens(rng.randrange(0, 4))
        else:  # anything, up to long multi-chunk prefills
            prompt = self._tokens(rng.randrange(1, 120))
        return prompt[: self.max_model_len - 2]

    def params(self) -> SamplingParams:
        rng = self.rng
        kw: dict[str, Any] = {}
        if rng.random() < 0.4:
            kw["temperature"] = 0.0
        else:
            kw["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.3])
            if rng.random() < 0.4:
                kw["top_p"] = rng.choice([0.5, 0.8, 0.95])
            if rng.random() < 0.4:
                kw["top_k"] = rng.choice([1, 5, 20, -1])
            if rng.random() < 0.3:
                kw["min_p"] = rng.choice([0.05, 0.1, 0.3])
        if rng.random() < 0.5:
            kw["seed"] = rng.randrange(1 << 31)
        if rng.random() < 0.12:
            kw["n"] = rng.choice([2, 3])
        max_tokens = rng.choice([1, 2, 5, 9, 16, 24, 32, 48, None])
        kw["max_tokens"] = max_tokens
        if rng.random() < 0.15:
            kw["min_tokens"] = rng.randrange(0, (max_tokens or 8) + 1)
        if rng.random() < 0.3:
            kw["stop"] = [rng.choice(self.words[FIRST_WORD:]) for _ in range(rng.randrange(1, 3))]
            kw["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.2:
            kw["stop_token_ids"] = [rng.randrange(FIRST_WORD, VOCAB)]
        if rng.random() < 0.3:
            kw["ignore_eos"] = True
        if rng.random() < 0.3:
            kw["logprobs"] = rng.choice([0, 1, 5])
        if rng.random() < 0.08:
            kw["prompt_logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.25:
            kw["presence_penalty"] = rng.choice([-0.5, 0.5, 1.5])
        if rng.random() < 0.25:
            kw["frequency_penalty"] = rng.choice([-0.5, 0.5, 1.0])
        if rng.random() < 0.25:
            kw["repetition_penalty"] = rng.choice([0.8, 1.2, 1.8])
        if rng.random() < 0.1:
            kw["logit_bias"] = {rng.randrange(VOCAB): rng.choice([-5.0, 5.0])}
        if rng.random() < 0.08:
            kw["allowed_token_ids"] = rng.sample(range(FIRST_WORD, VOCAB), 20) + [EOS]
        if rng.random() < 0.08:
            kw["bad_words"] = [rng.choice(self.words[FIRST_WORD:])]
        return SamplingParams(**kw)
