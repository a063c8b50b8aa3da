"""Chained hashes of full KV blocks for prefix caching.

hash_i = sha256(hash_{i-1} || tokens of block i || extra keys of block i). Positions are implied
by the chain, so equal hashes mean equal prefixes. Only committed tokens are hashed: drafts and
diffusion canvases never are.
"""

from __future__ import annotations

import hashlib
from array import array

from impasto.core.request import Request

# Root of every chain. Fixed, so hashes are reproducible across processes.
NONE_HASH = hashlib.sha256(b"impasto-prefix-cache-root").digest()


def hash_block(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x00extra")
        h.update(extra)
    return h.digest()


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend `request.block_hashes` to cover every full block of committed tokens."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) >= num_full:
        return hashes
    tokens = request.all_token_ids
    parent = hashes[-1] if hashes else NONE_HASH
    for i in range(len(hashes), num_full):
        # The cache salt isolates tenants: it keys the first block, hence the whole chain.
        extra = request.cache_salt.encode() if (i == 0 and request.cache_salt) else b""
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes
