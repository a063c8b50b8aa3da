"""The model runner: SchedulerOutput -> tensors -> forward -> sample -> ModelRunnerOutput.

It owns the paged KV cache and the persistent batch, and knows each request only through the
scheduler's diffs. Device-agnostic PyTorch: CPU by default, CUDA when asked.

Faults stay with the requests they hit: a request whose logits are not finite (NaN/inf from the
model) is reported in `failed_req_ids` and gets no token (its rows are zeroed before sampling,
so the others sample as usual); a step that raised is repaired by `discard_step`, which leaves
the persistent batch as if the step's requests had never been scheduled.
"""

from __future__ import annotations

import numpy as np
import torch

from impasto.attention.metadata import AttentionMetadata
from impasto.attention.registry import get_attention_backend
from impasto.core.outputs import ModelRunnerOutput, SchedulerOutput
from impasto.models.interface import CausalLM
from impasto.worker.attn_inputs import build_attention_metadata
from impasto.worker.forward import model_forward
from impasto.worker.input_batch import InputBatch
from impasto.worker.kv_cache import allocate_kv_caches
from impasto.worker.request_state import Phase, RequestState
from impasto.worker.sampler import Sampler, SamplerOutput, SamplingMetadata, compute_prompt_logprobs
from impasto.worker.sampling_ops import finite_rows
from impasto.worker.spec_decode import Proposer, RejectionSampler, StepResult
from impasto.worker.token_masks import apply_token_masks, resolve


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_reqs: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        self.model = model
        self.attn_backend = get_attention_backend()  # the registry's default
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, dtype, self.device)
        max_blocks = -(-max_model_len // block_size)
        self.batch = InputBatch(max_num_reqs, max_model_len, max_blocks)
        self.requests: dict[str, RequestState] = {}  # running and preempted requests
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.proposer: Proposer | None = None  # set by the engine when speculation is on
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def take_stats(self) -> dict[str, float]:
        """Metric counter increments since the previous call (none for AR runners: the
        scheduler counts tokens and drafts)."""
        return {}

    # -- state diffs --------------------------------------------------------------------------
    def _apply_removals(self, so: SchedulerOutput) -> None:
        """Finished requests leave; preempted ones leave the batch (idempotent: a request
        already gone is skipped, so a repair may apply a step's removals again)."""
        batch = self.batch
        for rid in so.finished_req_ids:
            batch.remove(rid)
            self.requests.pop(rid, None)
        for rid in so.preempted_req_ids:
            state = batch.remove(rid)
            if state is not None:  # its KV is gone: it restarts from a prefill
                state.on_preempted()

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        self._apply_removals(so)
        for new in so.scheduled_new_reqs:
            state = RequestState(new.req_id, list(new.prompt_token_ids), new.sampling_params, [])
            self.requests[new.req_id] = state
            batch.add(state, new.block_ids, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                state = self.requests[rid]
                state.output_token_ids = cached.resumed_token_ids[rid][
                    len(state.prompt_token_ids) :
                ]
                batch.add(state, cached.new_block_ids[i], cached.num_computed_tokens[i])
            else:
                row = batch.row_of[rid]
                batch.append_blocks(row, cached.new_block_ids[i])
                batch.num_computed[row] = cached.num_computed_tokens[i]

    def discard_step(self, so: SchedulerOutput) -> None:
        """Repair after a step that raised (anywhere, even halfway through `_update_states`):
        the step's requests are failed by the scheduler, so their rows go now; the removals
        the step carried are applied."""
        self._apply_removals(so)
        for rid in so.num_scheduled_tokens:
            self.batch.remove(rid)
            self.requests.pop(rid, None)

    # -- one step -----------------------------------------------------------------------------
    def _scheduled_rows(
        self, so: SchedulerOutput, req_ids: list[str]
    ) -> tuple[np.ndarray, np.ndarray]:
        """[B] persistent-batch rows of the step's requests and [B] tokens scheduled for each."""
        rows = np.fromiter((self.batch.row_of[r] for r in req_ids), np.int64, len(req_ids))
        sched = so.num_scheduled_tokens
        return rows, np.fromiter((sched[r] for r in req_ids), np.int64, len(req_ids))

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [])
        batch = self.batch
        rows, num_sched = self._scheduled_rows(so, req_ids)
        spec = so.scheduled_spec_decode_tokens
        for rid, drafts in spec.items():  # drafts follow the committed tokens in the buffer
            row = batch.row_of[rid]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n : n + len(drafts)] = drafts
        meta, input_ids = self._prepare_inputs(rows, num_sched)

        # Rows whose query reaches the end of the committed tokens sample 1 + len(drafts)
        # tokens; the others are prefill chunks.
        start = batch.num_computed[rows]
        num_tokens = batch.num_tokens[rows]
        cu = np.concatenate(([0], np.cumsum(num_sched)))
        sample_plan: list[tuple[int, int, int]] = []  # (batch index, first logits row, rows)
        logits_idx: list[int] = []
        for b, rid in enumerate(req_ids):
            end = int(start[b] + num_sched[b])
            if end < num_tokens[b]:
                continue
            k = len(spec.get(rid, ()))
            first = int(cu[b] + num_tokens[b] - 1 - start[b])
            sample_plan.append((b, len(logits_idx), k + 1))
            logits_idx.extend(range(first, first + k + 1))

        with model_forward(self.attn_backend, meta, self.kv_caches):
            hidden = self.model(input_ids, meta.positions)
        prompt_lps = self._prompt_logprobs(req_ids, rows, start, num_sched, cu, hidden)

        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, list[dict[int, tuple[float, int]]]] = {}
        failed: dict[str, str] = {}
        if logits_idx:
            idx = torch.tensor(logits_idx, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, idx))
            failed = self._fail_non_finite(logits, req_ids, sample_plan)
            masks = resolve(so.grammar_masks)  # filled while the forward pass ran
            if masks is not None:  # after the finite check: masked logits are -inf
                apply_token_masks(logits, masks, req_ids, sample_plan)
            sampling = self._sampling_metadata(req_ids, rows, sample_plan, spec)
            num_accepted = None
            if any(req_ids[b] in spec for b, _, _ in sample_plan):
                out, num_accepted = self._verify(logits, sampling, req_ids, rows, sample_plan, spec)
            else:
                out = self.sampler(logits, sampling)
            tokens = out.sampled_token_ids.tolist()
            lp_rows = None
            if out.logprobs is not None:
                num_top = [
                    self.batch.states[rows[b]].sampling_params.logprobs or 0
                    for b, _, k in sample_plan
                    for _ in range(k)
                ]
                lp_rows = out.logprobs.to_dicts(num_top)
            for i, (b, first, _) in enumerate(sample_plan):
                if req_ids[b] in failed:
                    continue
                # Rows first..first+accepted hold the accepted drafts and the bonus/correction.
                accepted = num_accepted[i] if num_accepted is not None else 0
                toks = tokens[first : first + accepted + 1]
                sampled[b] = toks
                state = self.batch.states[rows[b]]
                state.phase = Phase.DECODE
                batch.append_tokens(int(rows[b]), toks)
                if lp_rows is not None and state.sampling_params.logprobs is not None:
                    logprobs[req_ids[b]] = lp_rows[first : first + len(toks)]
        drafts_next = None
        if self.proposer is not None:
            verified = [spec.get(r, []) for r in req_ids]
            step = StepResult(req_ids, rows, start, num_sched, sampled, verified)
            drafts_next = self.proposer.propose(batch, step)
        result = ModelRunnerOutput(req_ids, sampled, drafts_next, logprobs, prompt_lps)
        result.failed_req_ids = failed
        return result

    @staticmethod
    def _fail_non_finite(
        logits: torch.Tensor, req_ids: list[str], plan: list[tuple[int, int, int]]
    ) -> dict[str, str]:
        """Requests with a non-finite logit in any of their rows, with the error; those rows
        are zeroed in place so the batch samples as usual (their tokens are discarded)."""
        finite = finite_rows(logits)
        if bool(finite.all()):
            return {}
        ok = finite.tolist()
        failed: dict[str, str] = {}
        for b, first, k in plan:
            if not all(ok[first : first + k]):
                failed[req_ids[b]] = "the model produced non-finite logits (NaN or inf)"
        logits[~finite] = 0.0
        return failed

    def _verify(
        self,
        logits: torch.Tensor,
        sampling: SamplingMetadata,
        req_ids: list[str],
        rows: np.ndarray,
        plan: list[tuple[int, int, int]],
        spec: dict[str, list[int]],
    ) -> tuple[SamplerOutput, list[int]]:
        """Rejection-sample the rows of a step with drafts (losslessly, any sampling params)."""
        drafts = [spec.get(req_ids[b], []) for b, _, _ in plan]
        # A draft model's q for random requests; None: deterministic drafts (one-hot q).
        q = [self._draft_probs(self.batch.states[rows[b]]) for b, _, _ in plan]
        first_k = [(first, k - 1) for _, first, k in plan]
        return self.rejection_sampler(logits, sampling, first_k, drafts, q)

    @staticmethod
    def _draft_probs(state: RequestState) -> torch.Tensor | None:
        draft = state.resident.draft
        return None if draft is None else draft.probs

    def _prepare_inputs(
        self, rows: np.ndarray, num_sched: np.ndarray
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        batch = self.batch
        start = batch.num_computed[rows]
        meta, req_idx, positions = build_attention_metadata(
            batch.block_table, rows, start, num_sched, self.block_size, self.device
        )
        # -1 placeholder drafts (uniform padding) are clamped before the embedding lookup.
        input_ids = np.maximum(batch.token_ids[rows[req_idx], positions], 0)
        return meta, torch.from_numpy(input_ids).to(self.device)

    def _sampling_metadata(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        plan: list[tuple[int, int, int]],
        spec: dict[str, list[int]],
    ) -> SamplingMetadata:
        params, outputs, prompts, positions = [], [], [], []
        for b, _, k in plan:
            state = self.batch.states[rows[b]]
            drafts = spec.get(req_ids[b], [])
            for j in range(k):
                params.append(state.sampling_params)
                # Row j samples the token after drafts[:j]: penalties and seeds see them.
                out = state.output_token_ids + drafts[:j] if j else state.output_token_ids
                outputs.append(out)
                prompts.append(state.prompt_token_ids)
                positions.append(state.num_tokens + j)
        return SamplingMetadata.from_params(
            params, outputs, prompts, positions, self.device, self.generator
        )

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        start: np.ndarray,
        num_sched: np.ndarray,
        cu: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, list[dict[int, tuple[float, int]] | None]]:
        """Accumulate prompt logprobs chunk by chunk; hand them out when the prompt is done."""
        done: dict[str, list[dict[int, tuple[float, int]] | None]] = {}
        for b, rid in enumerate(req_ids):
            state = self.batch.states[rows[b]]
            num_top = state.sampling_params.prompt_logprobs
            if num_top is None or state.prompt_logprobs_done:
                continue
            prompt = state.prompt_token_ids
            acc = state.resident.prompt_logprobs
            if acc is None:
                acc = state.resident.prompt_logprobs = [None]  # no logprob for token 0
            lo = int(start[b])
            hi = min(int(start[b] + num_sched[b]), len(prompt) - 1)  # positions with a next token
            if hi > lo:
                h = hidden[int(cu[b]) : int(cu[b]) + (hi - lo)]
                nxt = torch.tensor(prompt[lo + 1 : hi + 1], device=self.device)
                lps = compute_prompt_logprobs(self.model.compute_logits(h), nxt, num_top)
                acc.extend(lps.to_dicts([num_top] * (hi - lo)))
            if start[b] + num_sched[b] >= len(prompt):
                state.prompt_logprobs_done = True
                done[rid], state.resident.prompt_logprobs = acc, None
        return done
