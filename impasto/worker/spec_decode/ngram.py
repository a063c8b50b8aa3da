"""N-gram (prompt lookup) proposer: find the latest earlier occurrence of the sequence's last n
tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose what followed it.

Per request an incremental index maps the hash of every n-gram to the latest position where it
ends. Each step only the n-grams ending at new positions are hashed (numpy, vectorised over
positions) and inserted, so a step costs O(new tokens * n sizes), never a scan of the history.
A hit is checked token by token (hash collisions are rare but possible).

When the continuation runs into the end of the sequence the match is periodic (the suffix
repeats with period p = distance between the two occurrences) and the drafts continue the
period: a model caught in a loop gets full-length drafts.
"""

from __future__ import annotations

import numpy as np

from impasto.config.speculative import SpeculativeConfig
from impasto.worker.input_batch import InputBatch
from impasto.worker.spec_decode.proposer import Proposer, StepResult

_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier; arithmetic wraps mod 2^64


def ngram_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """`[L]` int64 -> `[L - n + 1]` uint64: hash of tokens[e-n+1 : e+1] for e = n-1 .. L-1."""
    t = tokens.astype(np.uint64) + np.uint64(1)
    h = t[n - 1 :].copy()
    with np.errstate(over="ignore"):
        for j in range(1, n):  # h = sum_j t[e - j] * MULT^j (mod 2^64)
            h = h * _MULT + t[n - 1 - j : len(t) - j]
    return h


class NgramIndex:
    """Latest end position of every n-gram (lo <= n <= hi) ending before `indexed`."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.maps: dict[int, dict[int, int]] = {n: {} for n in range(lo, hi + 1)}
        self.indexed = 0  # n-grams ending at positions < indexed are in the maps

    def extend(self, tokens: np.ndarray, upto: int) -> None:
        """Index n-grams ending at positions [indexed, upto)."""
        if upto <= self.indexed:
            return
        base = max(self.indexed - self.hi + 1, 0)
        window = tokens[base:upto]
        for n, table in self.maps.items():
            first_end = max(self.indexed, base + n - 1)  # first new end position with n tokens
            if first_end >= upto:
                continue
            h = ngram_hashes(window, n)  # h[i] ends at base + n - 1 + i
            h = h[first_end - (base + n - 1) :]
            table.update(zip(h.tolist(), range(first_end, upto), strict=True))
        self.indexed = upto

    def lookup(self, tokens: np.ndarray, length: int, k: int) -> list[int]:
        """Up to k drafts following the longest earlier match of tokens[:length]'s suffix."""
        for n in range(min(self.hi, length - 1), self.lo - 1, -1):
            suffix = tokens[length - n : length]
            end = self.maps[n].get(int(ngram_hashes(suffix, n)[0]))
            if end is None or not np.array_equal(tokens[end - n + 1 : end + 1], suffix):
                continue
            period = length - 1 - end  # > 0: only ends before length - 1 are indexed
            idx = length - period + np.arange(k) % period  # continue periodically past the end
            return tokens[idx].tolist()
        return []


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, batch: InputBatch, step: StepResult) -> list[list[int]]:
        ks = self.num_drafts(batch, step)
        out: list[list[int]] = []
        for b, k in enumerate(ks):
            if k <= 0:
                out.append([])
                continue
            row = int(step.rows[b])
            state = batch.states[row]
            index = state.resident.ngram
            if index is None:
                index = state.resident.ngram = NgramIndex(self.lo, self.hi)
            length = int(batch.num_tokens[row])
            tokens = batch.token_ids[row]  # committed tokens are tokens[:length]
            # The suffix itself (ending at length - 1) must not match itself: index up to it.
            index.extend(tokens, length - 1)
            out.append(index.lookup(tokens, length, k))
        return out
