"""The masked block-diffusion runner: whole-block prefill, then (DENOISE x k -> commit)* per
request, every block's commit fused with the next block's first denoising step.

What a scheduled span of a request holds (the scheduler's `_block_tokens` makes it so):

    | prefill: whole blocks | block k: final tokens (commit) | block k+1: prompt tail + masks |
      written, block-causal   written, block-causal            read-only (slot -1), denoised

Every part is optional except that a canvas (the request's spec tokens) always ends the span
with its active block: the last B-block of the span, holding masks. The attention is
block-causal for every row (`AttentionMetadata.causal_block`): a row sees its own block and
all blocks before it, so one forward both writes the finished block's KV (exactly what a
prefill of those tokens writes) and denoises the next block against it. A block whose last
mask was just committed is reported as sampled on the next step, once that step wrote its KV:
until then the scheduler counts it as canvas, never as computed.

Token shift (Fast-dLLM v2): slot j's logits come from the hidden state at j - 1. For slot 0
that is the previous block's last token, which is only in the span on the block's first step
(the commit rows, or the prefill's last row): it is kept (`ResidentState.shift_hidden`) for
the later steps, and the first step commits slot 0 whatever the rule (it is the AR next token of a
finished prefix, as Fast-dLLM v2 decodes it). The scheduler recomputes at least the last whole
block after a prefix-cache hit (hits end at num_tokens - 1), so that row is always seen.

Preemption drops the block (`RequestState.on_preempted`); the request resumes from its
committed tokens, and since every draw depends only on (seed, position, step) it redoes the
same block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from impasto.config.block_diffusion import BlockDiffusionConfig, UnmaskingParams
from impasto.core.outputs import ModelRunnerOutput, SchedulerOutput
from impasto.models.interface import CausalLM
from impasto.worker.block_diffusion.unmasking import choose, propose
from impasto.worker.forward import model_forward
from impasto.worker.model_runner import ModelRunner
from impasto.worker.request_state import Phase, RequestState
from impasto.worker.sampling_ops import finite_rows


@dataclass
class BlockState:
    """One request's block in flight. Dropped on preemption."""

    start: int  # absolute position of slot 0 (a multiple of the block size)
    tokens: np.ndarray  # [L] int64: prompt tail, committed candidates, masks (L <= B)
    masked: np.ndarray  # [L] bool
    params: UnmaskingParams
    step: int = 0  # denoising steps done on this block

    @property
    def done(self) -> bool:
        return not bool(self.masked.any())


@dataclass
class _Work:
    """One request's share of a step."""

    b: int  # batch index
    row: int  # persistent-batch row
    state: RequestState
    computed: int  # first position of the span
    end: int  # one past its last position
    commit: list[int]  # final tokens of the block committed by this step (after the tail)
    block: BlockState | None  # the active block (denoised this step), if any


class MaskedBlockRunner(ModelRunner):
    def __init__(self, model: CausalLM, *, config: BlockDiffusionConfig, seed: int = 0, **kwargs):
        super().__init__(model, seed=seed, **kwargs)
        self.config = config
        self.dblock = config.block_size  # the diffusion block (self.block_size: KV pages)
        self.seed = seed
        self.stats = {"steps": 0, "positions": 0, "blocks": 0, "tokens": 0}

    def take_stats(self) -> dict[str, float]:
        s, self.stats = self.stats, dict.fromkeys(self.stats, 0)
        return {
            "impasto:diffusion_denoising_steps": s["steps"],
            "impasto:diffusion_canvas_positions": s["positions"],
            "impasto:diffusion_canvases_committed": s["blocks"],
            "impasto:diffusion_committed_tokens": s["tokens"],
        }

    def _seed(self, state: RequestState) -> int:
        s = state.sampling_params.seed
        return self.seed if s is None else int(s)

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [], [])
        batch = self.batch
        rows, num_sched = self._scheduled_rows(so, req_ids)
        work = [self._plan(so, b, int(rows[b]), int(num_sched[b])) for b in range(len(rows))]
        meta, input_ids = self._prepare_inputs(rows, num_sched)
        meta.causal_block = [self.dblock] * len(rows)
        cu = np.concatenate(([0], np.cumsum(num_sched)))
        read_only = [
            np.arange(cu[w.b] + w.block.start - w.computed, cu[w.b + 1])
            for w in work
            if w.block is not None
        ]
        if read_only:
            idx = torch.from_numpy(np.concatenate(read_only)).to(self.device)
            meta.slot_mapping = meta.slot_mapping.index_fill(0, idx, -1)
        with model_forward(self.attn_backend, meta, self.kv_caches):
            hidden = self.model(input_ids, meta.positions)

        failed: dict[str, str] = {}
        self._denoise([w for w in work if w.block is not None], hidden, cu, failed)
        sampled: list[list[int]] = []
        spec: list[list[int]] = []
        for w in work:
            if self.config.token_shift:
                self._keep_prev_hidden(w, hidden, cu)
            if w.commit:
                batch.append_tokens(w.row, w.commit)
                self.stats["blocks"] += 1
                self.stats["tokens"] += len(w.commit)
            sampled.append(w.commit)
            spec.append(self._next_canvas(w))
        out = ModelRunnerOutput(req_ids, sampled, spec)
        out.failed_req_ids = failed
        return out

    def _plan(self, so: SchedulerOutput, b: int, row: int, n: int) -> _Work:
        """Read the request's span: which block it commits, which it denoises (checked against
        the runner's own state: the scheduler and the runner must agree on the canvas)."""
        batch, bs = self.batch, self.dblock
        state = batch.states[row]
        computed, num_tokens = int(batch.num_computed[row]), int(batch.num_tokens[row])
        end = computed + n
        canvas = so.scheduled_spec_decode_tokens.get(state.req_id, [])
        if not canvas:  # whole blocks of committed tokens
            if computed % bs or (end % bs and end != num_tokens) or end > num_tokens:
                raise RuntimeError(f"request {state.req_id}: prefill [{computed}, {end}) unaligned")
            return _Work(b, row, state, computed, end, [], None)
        if end != num_tokens + len(canvas) or computed % bs:
            raise RuntimeError(
                f"request {state.req_id}: span [{computed}, {end}) is not its canvas "
                f"({len(canvas)} tokens after {num_tokens})"
            )
        batch.token_ids[row, num_tokens:end] = canvas
        active = (end - 1) // bs * bs  # the last block of the span
        old = state.resident.block
        commit: list[int] = []
        if old is not None and old.start < active:  # the finished block rides along
            if not old.done or old.start + len(old.tokens) != active:
                raise RuntimeError(f"request {state.req_id}: block at {old.start} not finished")
            commit = [int(t) for t in canvas[: active - num_tokens]]
            if commit != old.tokens[len(old.tokens) - len(commit) :].tolist():
                raise RuntimeError(f"request {state.req_id}: committed tokens differ")
            old = None
        if old is not None and old.start == active:
            if old.tokens[len(old.tokens) - len(canvas) :].tolist() != list(canvas):
                raise RuntimeError(f"request {state.req_id}: canvas differs from the runner's")
            if old.done:  # at max_model_len: nothing follows, the block commits alone
                state.resident.block = None
                return _Work(b, row, state, computed, end, [int(t) for t in canvas], None)
            return _Work(b, row, state, computed, end, commit, old)
        tokens = batch.token_ids[row, active:end].astype(np.int64)
        masked = np.arange(active, end) >= max(num_tokens, active)  # the tail is fixed
        if not (tokens[masked] == self.config.mask_token_id).all():
            raise RuntimeError(f"request {state.req_id}: a new block must start as masks")
        params = self.config.unmasking.override(state.sampling_params.extra_args, bs)
        block = BlockState(active, tokens, masked, params)
        state.resident.block = block
        state.phase = Phase.DENOISE
        return _Work(b, row, state, computed, end, commit, block)

    def _hidden_row(self, w: _Work, pos: int, cu: np.ndarray) -> int | None:
        """Row of `hidden` holding position `pos` of the request, if this step computed it."""
        return int(cu[w.b] + pos - w.computed) if w.computed <= pos < w.end else None

    def _keep_prev_hidden(self, w: _Work, hidden: torch.Tensor, cu: np.ndarray) -> None:
        """Token shift: keep the hidden state before the next block to denoise (the active
        block's start, or the end of a prefill) when this step computed it."""
        start = w.block.start if w.block is not None else w.end
        r = self._hidden_row(w, start - 1, cu)
        if r is not None and start % self.dblock == 0:
            w.state.resident.shift_hidden = (start, hidden[r].clone())

    def _denoise(
        self, work: list[_Work], hidden: torch.Tensor, cu: np.ndarray, failed: dict[str, str]
    ) -> None:
        """One step of each active block: the logits of its masked slots in one LM-head call,
        candidates, the rule's choice, the block updated in place."""
        shift = self.config.token_shift
        picks: list[torch.Tensor] = []
        slots: list[np.ndarray] = []
        for w in work:
            block = w.block
            assert block is not None
            s = np.flatnonzero(block.masked)
            pos = block.start + s - (1 if shift else 0)  # the position each slot reads
            rows = [self._hidden_row(w, int(p), cu) for p in pos]
            if shift and rows[0] is None:  # slot 0 from the previous block's last token
                kept = w.state.resident.shift_hidden
                if kept is None or kept[0] != block.start:
                    raise RuntimeError(f"request {w.state.req_id}: no hidden state at slot 0")
                picks.append(kept[1][None])
                rows = rows[1:]
            picks.append(hidden[torch.tensor(rows, dtype=torch.int64, device=hidden.device)])
            slots.append(s)
        logits = self.model.compute_logits(torch.cat(picks))  # [sum m, V] float32
        finite = finite_rows(logits)  # before the mask token's -inf
        logits[:, self.config.mask_token_id] = float("-inf")
        first = 0
        for w, s in zip(work, slots, strict=True):
            block, m = w.block, len(s)
            assert block is not None
            part = slice(first, first + m)
            first += m
            if not bool(finite[part].all()):
                failed[w.state.req_id] = "the model produced non-finite logits (NaN or inf)"
                continue
            self._step_block(w.state, block, logits[part], s)

    def _step_block(
        self, state: RequestState, block: BlockState, logits: torch.Tensor, slots: np.ndarray
    ) -> None:
        sp, p, seed = state.sampling_params, block.params, self._seed(state)
        positions = (block.start + slots).tolist()
        cand = propose(logits, sp.temperature, sp.top_k, sp.top_p, seed, positions, block.step)
        forced = 0 if self.config.token_shift and block.step == 0 and slots[0] == 0 else None
        last = block.step + 1 >= p.steps_cap(self.dblock)
        keep = choose(cand, p, positions, seed, block.step, last, forced).numpy()
        chosen = slots[keep]
        block.tokens[chosen] = cand.tokens.numpy()[keep]
        block.masked[chosen] = False
        block.step += 1
        self.stats["steps"] += 1
        self.stats["positions"] += len(block.tokens)

    def _next_canvas(self, w: _Work) -> list[int]:
        """The request's spec tokens for the next step: its block from the first uncommitted
        position; a finished block is followed by the next block's masks (up to max_model_len)."""
        block = w.block
        if block is None:
            return []
        num_tokens = int(self.batch.num_tokens[w.row])
        out = block.tokens[num_tokens - block.start :].tolist()
        end = block.start + len(block.tokens)
        if block.done and end < self.max_model_len:
            out += [self.config.mask_token_id] * min(self.dblock, self.max_model_len - end)
        return out
