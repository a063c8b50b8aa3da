"""Test-only paged-KV harness: a block allocator, metadata builder and a chunked greedy loop.

It plays the runner's role just enough to drive a model the way the engine does: prompts are
prefilled in chunks (later chunks read the cached prefix), requests join at different steps,
and every step runs all active requests as one flattened batch (prefill chunks mixed with
decodes). The metadata comes from the runner's own builder (`build_attention_metadata`) and
forwards are opened like the runner's (`model_forward`). Block tables are padded with -1 so
that a backend reading past a request's blocks fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from impasto.attention.metadata import AttentionMetadata
from impasto.attention.registry import get_attention_backend
from impasto.worker.attn_inputs import build_attention_metadata
from impasto.worker.forward import model_forward


class BlockAllocator:
    """Hands out blocks in a shuffled order so that block tables are never contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("test harness ran out of KV blocks")
        out, self.free = self.free[:n], self.free[n:]
        return out


@dataclass
class Seq:
    tokens: list[int]
    num_computed: int = 0  # tokens whose KV is in the cache
    blocks: list[int] = field(default_factory=list)
    causal: bool = True


@dataclass
class Work:
    seq: Seq
    num_new: int  # query tokens this step: tokens[num_computed : num_computed + num_new]
    write: bool = True  # False: read-only step (slot -1, e.g. a diffusion denoise)


def build_metadata(work: list[Work], block_size: int) -> AttentionMetadata:
    """The runner's metadata for `work` (one row per request, in order); read-only requests
    and bidirectional ones edited like the diffusion runner's canvas rows."""
    table = np.full((len(work), max(len(w.seq.blocks) for w in work)), -1, dtype=np.int64)
    for b, w in enumerate(work):
        table[b, : len(w.seq.blocks)] = w.seq.blocks
    start = np.array([w.seq.num_computed for w in work], dtype=np.int64)
    qlens = np.array([w.num_new for w in work], dtype=np.int64)
    rows = np.arange(len(work), dtype=np.int64)
    meta, req_idx, _ = build_attention_metadata(
        table, rows, start, qlens, block_size, torch.device("cpu")
    )
    meta.causal = [w.seq.causal for w in work]
    read_only = torch.from_numpy(np.flatnonzero([not work[b].write for b in req_idx]))
    if read_only.numel():
        meta.slot_mapping = meta.slot_mapping.index_fill(0, read_only, -1)
    return meta


class PagedRunner:
    def __init__(
        self, model: nn.Module, num_blocks: int = 128, block_size: int = 4, dtype=torch.float32
    ) -> None:
        self.model, self.block_size = model, block_size
        self.allocator = BlockAllocator(num_blocks)
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, h, d, dtype=dtype)
            for h, d in model.kv_cache_shapes()
        ]

    @torch.inference_mode()
    def step(self, work: list[Work]) -> list[torch.Tensor]:
        """Run one batched forward; returns the logits [num_new, V] of each request."""
        for w in work:
            need = -(-(w.seq.num_computed + w.num_new) // self.block_size) - len(w.seq.blocks)
            if need > 0:
                w.seq.blocks += self.allocator.allocate(need)
        meta = build_metadata(work, self.block_size)
        ids = torch.tensor(
            [t for w in work for t in w.seq.tokens[w.seq.num_computed :][: w.num_new]]
        )
        with model_forward(get_attention_backend(), meta, self.kv_caches):
            hidden = self.model(ids, meta.positions)
        logits = self.model.compute_logits(hidden)
        for w in work:
            if w.write:
                w.seq.num_computed += w.num_new
        return list(logits.split(meta.query_lens))


def run_greedy(
    runner: PagedRunner, prompts: list[list[int]], max_new: int, chunk: int = 5
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Chunked prefill + batched greedy decode; request i joins at step i.

    Returns the generated tokens and, per request, the logits of its prompt positions.
    """
    seqs = [Seq(list(p)) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    prompt_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < max_new for o in outs):
        active = [i for i in range(min(step + 1, len(seqs))) if len(outs[i]) < max_new]
        work = [
            Work(seqs[i], min(chunk, len(seqs[i].tokens) - seqs[i].num_computed)) for i in active
        ]
        for i, logits in zip(active, runner.step(work), strict=True):
            s = seqs[i]
            if not outs[i]:
                prompt_logits[i].append(logits)
            if s.num_computed == len(s.tokens):  # caught up: sample the next token
                tok = int(logits[-1].argmax())
                s.tokens.append(tok)
                outs[i].append(tok)
        step += 1
    return outs, [torch.cat(lg)[: len(p)] for lg, p in zip(prompt_logits, prompts, strict=True)]
