"""The diffusion model runner: PREFILL -> (DENOISE x k -> COMMIT)* per request, explicitly.

Phase is the runner's own state (`RequestState.phase`), never inferred from query lengths:

- PREFILL: no canvas scheduled; a causal chunk that writes KV. When the committed tokens are
  all computed, a random canvas is drawn at position `num_tokens` -> DENOISE.
- DENOISE: the canvas (the request's spec tokens: all of it, or its tail clipped at
  max_model_len) is attended bidirectionally, read-only (`slot_mapping = -1`); the sampler
  updates it; 0 tokens are reported sampled. Converged -> COMMIT with the argmax canvas.
- COMMIT: one causal pass over the argmax canvas writes its KV; the canvas is reported as
  sampled (the scheduler truncates it at EOS / stop / max_tokens / max_model_len); a new
  canvas is drawn after it -> DENOISE.

Preemption resets the phase to PREFILL and drops the canvas (`RequestState.on_preempted`);
since the draws depend only on (seed, canvas start, step), the resumed request redoes the same
canvas.

The canvases denoised in one step share their vocabulary-sized work: one LM head product, one
pass of the sampler's per-position kernel and one self-conditioning product per chunk of
canvases (a chunk: whole canvases, up to WORKSPACE_BYTES of [rows, vocab] float32 logits, or
one canvas if that is larger), in a workspace kept across steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from impasto import kernels
from impasto.config.diffusion import DiffusionConfig
from impasto.core.outputs import ModelRunnerOutput, SchedulerOutput
from impasto.models.interface import DiffusionLM
from impasto.worker.diffusion.sampler import (
    CanvasJob,
    CanvasState,
    DiffusionSampler,
    StepResult,
    random_canvas,
)
from impasto.worker.forward import model_forward
from impasto.worker.model_runner import ModelRunner
from impasto.worker.request_state import Phase, RequestState
from impasto.worker.sampling_ops import finite_rows

WORKSPACE_BYTES = 128 << 20  # [rows, vocab] float32 logits of one chunk of canvases


@dataclass
class DiffusionStats:
    """Counters since the last `take()`; tokens per forward = committed / denoising steps."""

    denoising_steps: int = 0  # request-level decoder passes
    canvas_positions: int = 0  # canvas positions evaluated by those passes
    canvases_committed: int = 0
    committed_tokens: int = 0  # before stop/length truncation by the scheduler

    def take(self) -> DiffusionStats:
        out = DiffusionStats(**vars(self))
        for name in vars(out):
            setattr(self, name, 0)
        return out


class DiffusionModelRunner(ModelRunner):
    model: DiffusionLM

    def __init__(
        self, model: DiffusionLM, *, diffusion_config: DiffusionConfig, seed: int = 0, **kwargs
    ):
        super().__init__(model, seed=seed, **kwargs)
        self.config = diffusion_config
        self.canvas_length = diffusion_config.canvas_length
        self.seed = seed
        self.vocab = int(model.vocab_size)
        # The sampler's row kernel and soft-capping serve every dtype on CPU (float32 math).
        ops = kernels.load() if self.device.type == "cpu" else None
        model.use_kernels(ops)
        self.canvas_sampler = DiffusionSampler(diffusion_config, self.vocab, ops)
        self.stats = DiffusionStats()
        self._workspace = torch.empty(0, device=self.device)  # grown on demand, kept

    def take_stats(self) -> dict[str, float]:
        """The canvas counters since the previous call, as metric increments."""
        stats = self.stats.take()
        return {
            "impasto:diffusion_denoising_steps": stats.denoising_steps,
            "impasto:diffusion_canvas_positions": stats.canvas_positions,
            "impasto:diffusion_canvases_committed": stats.canvases_committed,
            "impasto:diffusion_committed_tokens": stats.committed_tokens,
        }

    def _seed(self, state: RequestState) -> int:
        s = state.sampling_params.seed
        return self.seed if s is None else int(s)

    @staticmethod
    def _canvas(state: RequestState) -> CanvasState:
        canvas = state.resident.canvas
        if canvas is None:  # DENOISE / COMMIT always have one: set on leaving PREFILL
            raise RuntimeError(f"request {state.req_id}: no canvas in phase {state.phase.name}")
        return canvas

    @staticmethod
    def _committing(canvas: CanvasState) -> torch.Tensor:
        """The argmax canvas a COMMIT step writes (set by the step that converged)."""
        if canvas.argmax is None:
            raise RuntimeError(f"canvas at {canvas.start} committed before any denoising step")
        return canvas.argmax

    def _new_canvas(self, state: RequestState) -> CanvasState:
        start = state.num_tokens
        tokens = random_canvas(self.vocab, self.canvas_length, self._seed(state), start, -1)
        canvas = CanvasState(start, tokens)
        state.resident.canvas = canvas
        state.phase = Phase.DENOISE
        return canvas

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            return ModelRunnerOutput([], [], [])
        batch = self.batch
        rows, num_sched = self._scheduled_rows(so, req_ids)
        states = [batch.states[r] for r in rows]
        phases = [self._check_phase(s, so, int(n)) for s, n in zip(states, num_sched, strict=True)]
        for b, (state, phase) in enumerate(zip(states, phases, strict=True)):
            if phase is not Phase.PREFILL:  # the canvas follows the committed tokens
                c = self._canvas(state)
                toks = self._committing(c) if phase is Phase.COMMIT else c.tokens
                n, row = int(num_sched[b]), int(rows[b])
                if c.start != batch.num_tokens[row]:  # invariant: it follows the committed tokens
                    raise RuntimeError(
                        f"request {state.req_id}: canvas at {c.start}, not at the end"
                    )
                batch.token_ids[row, c.start : c.start + n] = toks[:n].cpu().numpy()
        meta, input_ids = self._prepare_inputs(rows, num_sched)

        # Decoder-mode rows: bidirectional, read-only, self-conditioned.
        cu = np.concatenate(([0], np.cumsum(num_sched)))
        denoise = [b for b, p in enumerate(phases) if p is Phase.DENOISE]
        sc_rows = sc_soft = None
        if denoise:
            idx = np.concatenate([np.arange(cu[b], cu[b + 1]) for b in denoise])
            sc_rows = torch.from_numpy(idx).to(self.device)
            meta.slot_mapping = meta.slot_mapping.index_fill(0, sc_rows, -1)
            for b in denoise:
                meta.causal[b] = False
            sc_soft = self._soft_inputs([states[b] for b in denoise], num_sched[denoise])
        # The step's attention plan is built here, after the denoise rows' edits above.
        with model_forward(self.attn_backend, meta, self.kv_caches):
            hidden = self.model(input_ids, meta.positions, sc_rows, sc_soft)

        failed: dict[str, str] = {}
        canvases = iter(
            self._denoise(
                [states[b] for b in denoise],
                [int(n) for n in num_sched[denoise]],
                sc_rows,
                hidden,
                failed,
            )
        )
        sampled: list[list[int]] = []
        spec: list[list[int]] = []
        for b, (state, phase) in enumerate(zip(states, phases, strict=True)):
            n, row = int(num_sched[b]), int(rows[b])
            if phase is Phase.PREFILL:
                sampled.append([])
                done = batch.num_computed[row] + n >= batch.num_tokens[row]
                spec.append(self._new_canvas(state).tokens.tolist() if done else [])
            elif phase is Phase.DENOISE:
                sampled.append([])
                spec.append(next(canvases))
            else:  # COMMIT: its KV was written by this causal pass
                committed = self._committing(self._canvas(state))[:n].tolist()
                batch.append_tokens(row, committed)
                self.stats.canvases_committed += 1
                self.stats.committed_tokens += n
                sampled.append(committed)
                spec.append(self._new_canvas(state).tokens.tolist())
        out = ModelRunnerOutput(req_ids, sampled, spec)
        out.failed_req_ids = failed
        return out

    def _check_phase(self, state: RequestState, so: SchedulerOutput, n: int) -> Phase:
        """The request's phase this step, cross-checked against what was scheduled."""
        scheduled = so.scheduled_spec_decode_tokens.get(state.req_id)
        if not scheduled:
            if state.phase is not Phase.PREFILL:
                # A canvas is all-or-nothing: a running canvas is never scheduled partially.
                raise RuntimeError(f"request {state.req_id}: {n} tokens without its canvas")
            return Phase.PREFILL
        canvas = state.resident.canvas
        if state.phase is Phase.PREFILL or canvas is None:
            raise RuntimeError(f"request {state.req_id}: canvas scheduled before its prefill")
        expected = min(self.canvas_length, self.max_model_len - canvas.start)
        if not (len(scheduled) == n == expected):
            raise RuntimeError(
                f"request {state.req_id}: scheduled {n} tokens / {len(scheduled)} canvas "
                f"tokens, expected exactly its canvas ({expected})"
            )
        return state.phase

    def _soft_inputs(self, states: list[RequestState], lens: np.ndarray) -> torch.Tensor:
        """[sum n, H] self-conditioning embeddings (zeros on a canvas' first step)."""
        h = self.model.hidden_size
        parts = []
        for state, n in zip(states, lens, strict=True):
            soft = self._canvas(state).soft
            if soft is None:
                soft = torch.zeros(int(n), h, dtype=self.kv_caches[0].dtype, device=self.device)
            parts.append(soft[: int(n)])
        return torch.cat(parts)

    def _denoise(
        self,
        states: list[RequestState],
        lens: list[int],
        rows: torch.Tensor | None,  # [sum lens] rows of `hidden`, canvas after canvas
        hidden: torch.Tensor,  # [T, H]
        failed: dict[str, str],
    ) -> list[list[int]]:
        """One denoising step of each canvas (in order) -> each one's next spec tokens.
        A canvas with a non-finite logit goes into `failed` (its rows are zeroed, so the
        chunk samples as usual; the scheduler discards its canvas)."""
        out: list[list[int]] = []
        if not states:
            return out
        assert rows is not None
        start, i = 0, 0
        while i < len(states):
            j, n = i + 1, lens[i]  # a chunk: canvases i..j-1, n rows
            while j < len(states) and (n + lens[j]) * self.vocab * 4 <= WORKSPACE_BYTES:
                n, j = n + lens[j], j + 1
            h = hidden.index_select(0, rows[start : start + n])  # [n, H]
            logits = self.model.compute_logits(h, out=self._logits_buffer(n))  # [n, V] fp32
            finite = finite_rows(logits)  # [n]
            if not bool(finite.all()):
                row = 0
                for s, v in zip(states[i:j], lens[i:j], strict=True):
                    if not bool(finite[row : row + v].all()):
                        failed[s.req_id] = "the model produced non-finite logits (NaN or inf)"
                    row += v
                logits[~finite] = 0.0
            jobs = [
                CanvasJob(self._canvas(s), v, self._seed(s))
                for s, v in zip(states[i:j], lens[i:j], strict=True)
            ]
            results, probs = self.canvas_sampler.step_many(logits, jobs)
            out += self._advance(states[i:j], results, probs)
            start, i = start + n, j
        return out

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        if self._workspace.numel() < rows * self.vocab:
            self._workspace = torch.empty(rows * self.vocab, device=self.device)
        return self._workspace[: rows * self.vocab].view(rows, self.vocab)

    def _advance(
        self, states: list[RequestState], results: list[StepResult], probs: torch.Tensor
    ) -> list[list[int]]:
        """Canvases after their step: converged ones go to COMMIT with their argmax; the others
        get their renoised canvas and, in one product for all of them, the self-conditioning
        input of their next step. probs [sum valid, V]: the step's, canvas after canvas."""
        going = [k for k, r in enumerate(results) if not r.converged]
        if going:
            if len(going) < len(results):  # some converged: only the others need theirs
                probs = torch.cat([results[k].probs for k in going])
            soft = self.model.soft_embeddings(probs)  # [sum valid of going, H]
            soft_parts = iter(soft.split([results[k].probs.shape[0] for k in going]))
        out = []
        for state, res in zip(states, results, strict=True):
            canvas = self._canvas(state)
            valid = res.probs.shape[0]
            self.stats.denoising_steps += 1
            self.stats.canvas_positions += valid
            canvas.step += 1
            canvas.argmax = res.argmax
            if res.converged:
                state.phase = Phase.COMMIT
                canvas.soft = None
                out.append(res.argmax.tolist())
            else:
                canvas.tokens = res.canvas
                canvas.soft = next(soft_parts)  # the going canvases, in order
                out.append(res.canvas.tolist())
        return out
