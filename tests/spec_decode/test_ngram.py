"""The n-gram index: incremental updates agree with a brute-force prompt lookup."""

from __future__ import annotations

import random

import numpy as np

from impasto.worker.spec_decode.ngram import NgramIndex, ngram_hashes


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Latest earlier occurrence of the longest suffix n-gram (hi..lo), continued periodically."""
    n_tok = len(tokens)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        suffix = tokens[n_tok - n :]
        for end in range(n_tok - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[end + 1 + i])
                return ext[end + 1 : end + 1 + k]
    return []


def test_hashes_match_per_window():
    t = np.array([5, 1, 5, 1, 5, 2], dtype=np.int64)
    h = ngram_hashes(t, 3)
    assert len(h) == 4
    assert h[0] == h[2] and h[0] != h[1] and h[2] != h[3]
    assert ngram_hashes(t[2:5], 3)[0] == h[2]


def test_incremental_index_agrees_with_brute_force():
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice([3, 5, 50])
        lo, hi, k = rng.choice([(1, 3), (2, 4), (3, 3)]) + (rng.randint(1, 6),)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        buf = np.zeros(200, dtype=np.int64)
        buf[: len(tokens)] = tokens
        index = NgramIndex(lo, hi)
        while len(tokens) < 150:
            index.extend(buf, len(tokens) - 1)
            got = index.lookup(buf, len(tokens), k)
            assert got == brute_force(tokens, lo, hi, k), (trial, tokens)
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            buf[len(tokens) : len(tokens) + len(new)] = new
            tokens += new


def test_loop_gets_full_length_drafts():
    tokens = np.array([9, 1, 2, 3, 1, 2, 3, 1, 2] + [0] * 20, dtype=np.int64)
    index = NgramIndex(2, 4)
    index.extend(tokens, 8)
    assert index.lookup(tokens, 9, 7) == [3, 1, 2, 3, 1, 2, 3]
