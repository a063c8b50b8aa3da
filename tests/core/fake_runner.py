"""A fake model runner for scheduler tests: it produces plausible outputs without a model.

It keeps its own explicit per-request phase (as the real runner must), learned only from
the SchedulerOutput: prefill until the prompt is caught up, then (diffusion) denoise × k and
commit, or (AR) sample one token plus accepted drafts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from impasto.core.outputs import ModelRunnerOutput, SchedulerOutput


@dataclass
class _State:
    num_tokens: int  # committed tokens as the runner knows them
    num_computed: int
    denoise_steps: int = 0
    block_start: int = -1  # masked block diffusion: the block being denoised (-1: none)


class FakeRunner:
    def __init__(
        self,
        rng: random.Random,
        num_spec_tokens: int = 0,
        canvas_length: int = 0,
        denoise_steps: int | dict[str, int] = 2,
        vocab: int = 1000,
        eos_token_id: int | None = None,
        eos_prob: float = 0.0,
        masked_block: tuple[int, int, int] | None = None,  # (block size, mask id, max len)
    ) -> None:
        self.rng = rng
        self.block = masked_block
        self.k = num_spec_tokens
        self.canvas = canvas_length
        self.denoise_steps = denoise_steps
        self.vocab = vocab
        self.eos = eos_token_id
        self.eos_prob = eos_prob
        self.state: dict[str, _State] = {}

    def _token(self) -> int:
        if self.eos is not None and self.rng.random() < self.eos_prob:
            return self.eos
        return self.rng.randrange(self.vocab)

    def _denoise_steps(self, rid: str) -> int:
        if isinstance(self.denoise_steps, dict):
            return self.denoise_steps.get(rid, 2)
        return self.denoise_steps

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.state.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.state[new.req_id] = _State(len(new.prompt_token_ids), new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                self.state[rid] = _State(
                    len(cached.resumed_token_ids[rid]), cached.num_computed_tokens[i]
                )
        req_ids, sampled, spec = [], [], []
        for rid, n in out.num_scheduled_tokens.items():
            st = self.state[rid]
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            req_ids.append(rid)
            if self.block:
                toks, nxt = self._masked_block(st, n, drafts, self._denoise_steps(rid))
            elif self.canvas:
                toks, nxt = self._diffusion(st, n, drafts, self._denoise_steps(rid))
            else:
                toks, nxt = self._ar(st, n, drafts)
            sampled.append(toks)
            spec.append(nxt)
        keep_spec = self.k or self.canvas or self.block
        return ModelRunnerOutput(req_ids, sampled, spec if keep_spec else None)

    def _ar(self, st: _State, n: int, drafts: list[int]) -> tuple[list[int], list[int]]:
        assert len(drafts) < n or n == 0
        st.num_computed += n - len(drafts)
        if st.num_computed < st.num_tokens:  # prefill chunk: nothing sampled
            return [], []
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] >= 0 and self.rng.random() < 0.6:
            accepted += 1
        toks = drafts[:accepted] + [self._token()]
        st.num_computed += accepted
        st.num_tokens += len(toks)
        return toks, [self.rng.randrange(self.vocab) for _ in range(self.k)]

    def _diffusion(
        self, st: _State, n: int, canvas: list[int], denoise_steps: int
    ) -> tuple[list[int], list[int]]:
        if not canvas:  # prefill chunk (possibly a single token): explicit phase, no padding
            st.num_computed += n
            assert st.num_computed <= st.num_tokens, "a diffusion prefill overran the prompt"
            if st.num_computed == st.num_tokens:
                return [], self._new_canvas()
            return [], []
        assert n == len(canvas), f"canvas query of {n} tokens for a {len(canvas)} canvas"
        assert n <= self.canvas, f"{n} canvas tokens for a {self.canvas}-token canvas"
        if st.denoise_steps < denoise_steps:
            st.denoise_steps += 1
            return [], canvas
        st.denoise_steps = 0
        committed = [self._token() for _ in canvas]
        st.num_tokens += len(committed)
        st.num_computed = st.num_tokens
        return committed, self._new_canvas()

    def _masked_block(
        self, st: _State, n: int, canvas: list[int], denoise_steps: int
    ) -> tuple[list[int], list[int]]:
        """The block runner's protocol: whole-block prefill; a span ending with its active
        block; a finished block committed with the next block's first step."""
        assert self.block is not None
        b, mask, max_len = self.block
        start, end = st.num_computed, st.num_computed + n
        assert start % b == 0, f"span starts at {start}, inside a block of {b}"
        if not canvas:
            assert end % b == 0 and end <= st.num_tokens, f"prefill [{start}, {end}) unaligned"
            st.num_computed = end
            return [], []
        assert end == st.num_tokens + len(canvas) <= max_len
        active = (end - 1) // b * b
        assert end - active <= b and -1 not in canvas, "the canvas is not one block"
        committed: list[int] = []
        if 0 <= st.block_start < active:  # the finished block rides with the next one
            committed = canvas[: active - st.num_tokens]
            st.num_tokens += len(committed)
            st.block_start = -1
        elif st.block_start == active and mask not in canvas:  # at max_len: commit alone
            st.num_tokens += len(canvas)
            st.block_start = -1
            return canvas, []
        if st.block_start != active:
            assert all(t == mask for t in canvas[-(end - max(st.num_tokens, active)) :])
            st.block_start, st.denoise_steps = active, 0
        st.num_computed = active
        st.denoise_steps += 1
        tail = canvas[len(canvas) - (end - st.num_tokens) :]
        if st.denoise_steps < denoise_steps:
            return committed, tail
        finals = [self._token() for _ in tail]
        masks = [mask] * min(b, max_len - end)
        return committed, finals + masks

    def _new_canvas(self) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.canvas)]
