"""Draft-model proposer: a small model with the target's vocabulary proposes k tokens by k
sequential forwards, batched across requests.

Its paged KV cache is its own tensors, laid out like the target's and addressed through the
target's block tables: the scheduler reserves `num_lookahead_tokens = K` extra slots per
request, and preemption, abort and prefix caching need no bookkeeping of their own (a block
freed for the target is freed for the draft; a request resumes from its prefix hit for both).

With `draft_vocab_size` the draft's head scores token ids below it only: greedy drafts are its
argmax there, sampled drafts come from q with q = 0 beyond it (still a distribution, so the
rejection sampler stays exact).

Invariant (end of every step): for each running request, the draft cache holds the draft's KV
of every committed position below `state.resident.draft.kv_end`, and that is `>=` the target's
computed tokens. It follows that every full block the prefix cache hands out also holds the
draft's KV. Each step the draft first catches up on [draft_kv, end) - prefill chunks included,
so a cached block never lacks draft KV - then drafts; the KV it wrote for its own drafts
d1..d_{k-1} stays valid for the drafts the target accepts next step.
"""

from __future__ import annotations

import numpy as np
import torch

from impasto.attention.registry import get_attention_backend
from impasto.config.speculative import SpeculativeConfig
from impasto.models.interface import CausalLM
from impasto.sampling_params import SamplingParams
from impasto.worker import sampling_ops as ops
from impasto.worker.attn_inputs import build_attention_metadata
from impasto.worker.forward import model_forward
from impasto.worker.input_batch import InputBatch
from impasto.worker.kv_cache import allocate_kv_caches
from impasto.worker.request_state import DraftState
from impasto.worker.sampler import Sampler, SamplingMetadata
from impasto.worker.spec_decode.proposer import Proposer, StepResult
from impasto.worker.spec_decode.rejection_sampler import DRAFT_STREAM


class DraftModelProposer(Proposer):
    def __init__(
        self,
        config: SpeculativeConfig,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        super().__init__(config, max_model_len)
        self.model = model
        # the target's too (checked at load); the head may score fewer (draft_vocab_size)
        self.vocab_size = model.vocab_size
        self.attn_backend = get_attention_backend()  # the registry's default
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, dtype, self.device)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed ^ 0x5EED)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, step: StepResult) -> list[list[int]]:
        ks = self.num_drafts(batch, step)
        rows = step.rows
        num_tokens = batch.num_tokens[rows]
        # First position each request feeds this step, and the end of what it feeds.
        begin = np.empty(len(rows), dtype=np.int64)
        end = np.where(
            [bool(s) for s in step.sampled], num_tokens, step.start + step.num_sched
        ).astype(np.int64)
        for b in range(len(rows)):
            state = batch.states[int(rows[b])]
            prev = state.resident.draft
            if prev is None:  # new or resumed: the prefix hit holds the draft's KV too
                begin[b] = step.start[b]
                continue
            kv_end, t_prev, k_prev = prev.kv_end, prev.last_end, prev.num_drafted
            accepted = len(step.sampled[b]) - 1 if step.drafts[b] else 0
            # The KV of accepted drafts d1..d_{k_prev-1} (positions t_prev..) is still valid.
            begin[b] = max(kv_end, t_prev + min(max(accepted, 0), max(k_prev - 1, 0)))
        begin = np.minimum(begin, end)
        want = np.array(ks, dtype=np.int64)

        # Pass 1: catch up on [begin, end); the last position's logits give draft 1.
        qlens = end - begin
        live = np.nonzero(qlens > 0)[0]
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        if len(live):
            ids = np.concatenate([batch.token_ids[rows[b], begin[b] : end[b]] for b in live])
            hidden = self._forward(batch, rows[live], begin[live], qlens[live], ids)
            last = torch.from_numpy(np.cumsum(qlens[live]) - 1).to(self.device)
            sel = [i for i, b in enumerate(live) if want[b] > 0]
            if sel:
                h = hidden.index_select(0, last)[torch.tensor(sel, device=self.device)]
                self._sample(batch, step, live[sel], end[live[sel]], h, drafts, probs)

        # Passes 2..K: one token per request that still wants drafts.
        for j in range(1, int(want.max(initial=0))):
            act = np.array([b for b in range(len(rows)) if want[b] > j and drafts[b]], np.int64)
            if not len(act):
                break
            pos = end[act] + j - 1  # position of draft j (0-based: drafts[b][j - 1])
            ids = np.array([drafts[b][j - 1] for b in act], dtype=np.int64)
            hidden = self._forward(batch, rows[act], pos, np.ones(len(act), np.int64), ids)
            self._sample(batch, step, act, pos + 1, hidden, drafts, probs)

        for b in range(len(rows)):
            state = batch.states[int(rows[b])]
            # KV is valid below end[b]; positions end[b].. hold drafts[b][:-1].
            q = torch.stack(probs[b]) if probs[b] else None  # [k, V]
            state.resident.draft = DraftState(int(end[b]), int(end[b]), len(drafts[b]), q)
        return drafts

    def _forward(
        self,
        batch: InputBatch,
        rows: np.ndarray,  # [B]
        start: np.ndarray,  # [B] first position fed
        qlens: np.ndarray,  # [B] tokens fed
        ids: np.ndarray,  # [T] token ids, concatenated per request
    ) -> torch.Tensor:  # [T, H]
        meta, _, _ = build_attention_metadata(
            batch.block_table, rows, start, qlens, self.block_size, self.device
        )
        dev = self.device
        with model_forward(self.attn_backend, meta, self.kv_caches):
            return self.model(torch.from_numpy(np.maximum(ids, 0)).to(dev), meta.positions)

    def _sample(
        self,
        batch: InputBatch,
        step: StepResult,
        idx: np.ndarray,  # [n] request indices in `step`
        positions: np.ndarray,  # [n] sequence position of the token each samples
        hidden: torch.Tensor,  # [n, H]
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> None:
        """Greedy requests draft the draft's argmax; random ones sample from q (the draft's
        distribution under the request's temperature / top-k / top-p / min-p) and keep q for
        the rejection sampler."""
        logits = self.model.compute_logits(hidden).float()  # [n, V'] (V' < V: draft_vocab_size)
        params: list[SamplingParams] = [
            batch.states[int(step.rows[b])].sampling_params for b in idx
        ]
        tokens = logits.argmax(dim=-1)
        if not all(p.is_greedy for p in params):
            if logits.shape[1] < self.vocab_size:  # q is 0 past the draft's vocabulary
                full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
                full[:, : logits.shape[1]] = logits
                logits = full  # [n, V]
            n = len(params)
            meta = SamplingMetadata.from_params(
                params, [[]] * n, [[]] * n, positions.tolist(), self.device, self.generator
            )
            q = self.sampler.apply_temperature_and_filters(logits, meta).softmax(dim=-1)
            noise = ops.exponential_noise(
                tuple(q.shape), meta.seeds, meta.positions, self.generator, q.device, DRAFT_STREAM
            )
            greedy = torch.tensor([p.is_greedy for p in params], device=self.device)
            tokens = torch.where(greedy, tokens, ops.sample_from_probs(q, noise))
            for i, b in enumerate(idx):
                if not params[i].is_greedy:
                    probs[b].append(q[i])
        for b, t in zip(idx.tolist(), tokens.tolist(), strict=True):
            drafts[b].append(t)
