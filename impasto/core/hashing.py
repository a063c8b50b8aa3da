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


def chain_block_hashes(
    token_ids: list[int],
    block_size: int,
    cache_salt: str | None = None,
    start_block: int = 0,
    parent: bytes = NONE_HASH,
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on, chained from
    `parent` (the hash of block `start_block - 1`). The one definition of a block's hash: the
    KV cache and the data-parallel router (which predicts the engines' caches) both use it."""
    hashes = []
    for i in range(start_block, len(token_ids) // block_size):
        # The cache salt isolates tenants: it keys the first block, hence the whole chain.
        extra = cache_salt.encode() if (i == 0 and cache_salt) else b""
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend `request.block_hashes` to cover every full block of committed tokens."""
    hashes = request.block_hashes
    if len(hashes) >= request.num_tokens // block_size:
        return hashes
    parent = hashes[-1] if hashes else NONE_HASH
    hashes += chain_block_hashes(
        request.all_token_ids, block_size, request.cache_salt, len(hashes), parent
    )
    return hashes
