"""Engine-side per-request outputs: n > 1 fan-out, detokenization, stop strings, logprobs, and
the per-step *delta* `RequestOutput`s the engine emits.

A user request with `n` completions becomes n scheduler requests ("{i}_{id}" for n > 1), each
with its own seed (seed + i) so seeded children differ but stay reproducible.

Invariants:
- each step's output of a request carries only what is new (text, token ids, logprobs) for the
  completions that changed: the work per step is proportional to the step's new tokens, so a
  request of N tokens costs O(N) here in total (nothing here keeps or copies the whole output;
  the detokenizer keeps the text, which it needs for stop strings);
- streamed text never contains a partial stop string: until a completion finishes, the tail of
  its text that could still become a stop string is held back (`IncrementalDetokenizer`, the one
  place that does it), then released or cut;
- a stop string that completes inside a multi-token step (accepted drafts, a committed canvas)
  drops the tokens after the one that completed it, so ids, logprobs and usage match a
  one-token-per-step run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from impasto.core.outputs import EngineCoreOutput
from impasto.engine.detokenizer import IncrementalDetokenizer
from impasto.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from impasto.sampling_params import SamplingParams


@dataclass
class _Completion:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, _Completion]
    num_unfinished: int
    num_cached_tokens: int = 0


@dataclass
class _Pending:
    """What one step changed for one parent request."""

    parent: _Parent
    outputs: dict[int, CompletionOutput]
    prompt_logprobs: PromptLogprobs | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}

    def has(self, request_id: str) -> bool:
        return request_id in self.parents

    def add(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams
    ) -> list[tuple[str, SamplingParams]]:
        """Register a request; return its scheduler children (id, params)."""
        children: dict[str, _Completion] = {}
        out = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            p = params.clone() if params.n > 1 else params
            if params.n > 1:
                p.n = 1
                if p.seed is not None:
                    p.seed = p.seed + i
            detok = None
            if self.tokenizer is not None and p.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    p.skip_special_tokens,
                    p.spaces_between_special_tokens,
                    p.stop,
                    p.include_stop_str_in_output,
                )
            c = _Completion(i, p, detok)
            if p.logprobs is not None:
                c.cumulative_logprob = 0.0
            children[child_id] = c
            self.child_to_parent[child_id] = request_id
            out.append((child_id, p))
        self.parents[request_id] = _Parent(request_id, prompt, prompt_ids, children, params.n)
        return out

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def drop(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent:
            for child_id in parent.children:
                self.child_to_parent.pop(child_id, None)

    # -- one step -------------------------------------------------------------------------------
    def process(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Turn the scheduler's per-child outputs of a step into per-request deltas. Returns
        them and the child ids a stop string finished (the scheduler must finish those)."""
        pending: dict[str, _Pending] = {}
        stopped: list[str] = []
        for out in core_outputs:
            parent_id = self.child_to_parent.get(out.req_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            step = pending.get(parent_id)
            if step is None:
                step = pending[parent_id] = _Pending(parent, {})
            if out.prompt_logprobs is not None:
                step.prompt_logprobs = [self._logprob_dict(d) for d in out.prompt_logprobs]
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            delta, stop_hit = self._update(parent.children[out.req_id], out)
            if delta is not None:
                step.outputs[delta.index] = delta
                if delta.finish_reason is not None:
                    parent.num_unfinished -= 1
            if stop_hit:
                stopped.append(out.req_id)
        results = []
        for parent_id, step in pending.items():
            parent = step.parent
            finished = parent.num_unfinished == 0
            if not step.outputs and step.prompt_logprobs is None and not finished:
                continue
            results.append(
                RequestOutput(
                    request_id=parent_id,
                    prompt=parent.prompt,
                    prompt_token_ids=parent.prompt_token_ids,
                    outputs=sorted(step.outputs.values(), key=lambda c: c.index),
                    finished=finished,
                    prompt_logprobs=step.prompt_logprobs,
                    num_cached_tokens=parent.num_cached_tokens,
                )
            )
            if finished:
                self.drop(parent_id)
        return results, stopped

    def _update(
        self, c: _Completion, out: EngineCoreOutput
    ) -> tuple[CompletionOutput | None, bool]:
        """Apply one core output to a completion: (its delta or None, stop string hit)."""
        if c.finish_reason is not None:  # already finished (a stop string): ignore the rest
            return None, False
        new_ids, stop_str = out.new_token_ids, None
        if c.detok is not None:
            kept, stop_str = self._detokenize(c.detok, out)
            new_ids = new_ids[:kept]
        logprobs = None
        if c.cumulative_logprob is not None:
            logprobs = []
            for tok, entry in zip(new_ids, out.new_logprobs or (), strict=False):
                d = self._logprob_dict(entry)
                assert d is not None
                logprobs.append(d)
                c.cumulative_logprob += d[tok].logprob
        stop_hit = False
        if stop_str is not None:
            c.finish_reason, c.stop_reason = "stop", stop_str
            stop_hit = not out.finished
        elif out.finished:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        text = c.detok.get_delta_text() if c.detok is not None else ""
        if not new_ids and not text and c.finish_reason is None:
            return None, False
        delta = CompletionOutput(
            index=c.index,
            text=text,
            token_ids=list(new_ids),
            cumulative_logprob=c.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        return delta, stop_hit

    @staticmethod
    def _detokenize(detok: IncrementalDetokenizer, out: EngineCoreOutput) -> tuple[int, str | None]:
        """Feed the step's tokens to the detokenizer; return how many to keep and the stop string.

        With stop strings, a multi-token step is fed token by token so that the tokens after the
        one completing a stop string can be dropped.
        """
        ids = out.new_token_ids
        token_stop = (
            out.finish_reason == "stop"
            and out.stop_reason is None
            or isinstance(out.stop_reason, int)
        )
        if not detok.stop or len(ids) <= 1:
            stop = detok.update(
                ids, stop_terminated=out.finished and token_stop, finished=out.finished
            )
            return len(ids), stop
        for i, tok in enumerate(ids):
            last = i == len(ids) - 1
            stop = detok.update(
                [tok],
                stop_terminated=last and out.finished and token_stop,
                finished=last and out.finished,
            )
            if stop is not None:
                return i + 1, stop
        return len(ids), None

    def _logprob_dict(
        self, entry: dict[int, tuple[float, int]] | None
    ) -> dict[int, Logprob] | None:
        if entry is None:
            return None
        tok = self.tokenizer
        return {
            t: Logprob(lp, rank, tok.decode([t]) if tok is not None else None)
            for t, (lp, rank) in entry.items()
        }
