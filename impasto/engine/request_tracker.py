"""Engine-side per-request bookkeeping: n > 1 fan-out, text, logprobs, RequestOutput building.

A user request with `n` completions becomes n scheduler requests ("{i}_{id}" for n > 1),
each with its own seed (seed + i) so seeded children differ but stay reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from impasto.core.outputs import EngineCoreOutput
from impasto.engine.detokenizer import IncrementalDetokenizer
from impasto.outputs import CompletionOutput, Logprob, RequestOutput
from impasto.sampling_params import SamplingParams


@dataclass
class _Completion:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, _Completion]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0


class RequestTracker:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}

    def has(self, request_id: str) -> bool:
        return request_id in self.parents

    def add(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams
    ) -> list[tuple[str, SamplingParams]]:
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
                    p.stop,  # type: ignore[arg-type]
                    p.include_stop_str_in_output,
                )
            c = _Completion(i, p, detok)
            if p.logprobs is not None:
                c.logprobs, c.cumulative_logprob = [], 0.0
            children[child_id] = c
            self.child_to_parent[child_id] = request_id
            out.append((child_id, p))
        self.parents[request_id] = _Parent(request_id, prompt, prompt_ids, children)
        return out

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def parent_of(self, child_id: str) -> str | None:
        return self.child_to_parent.get(child_id)

    def drop(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent:
            for child_id in parent.children:
                self.child_to_parent.pop(child_id, None)

    def update(self, out: EngineCoreOutput) -> bool:
        """Apply one core output; return True if a stop string finished the request."""
        parent_id = self.child_to_parent.get(out.req_id)
        if parent_id is None:
            return False
        parent = self.parents[parent_id]
        c = parent.children[out.req_id]
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = [self._logprob_dict(d) for d in out.prompt_logprobs]
        new_ids, stop_str = list(out.new_token_ids), None
        if c.detok is not None and c.finish_reason is None:
            kept, stop_str = self._detokenize(c.detok, out)
            new_ids = new_ids[:kept]
        c.token_ids.extend(new_ids)
        if c.logprobs is not None and out.new_logprobs:
            for tok, entry in zip(new_ids, out.new_logprobs, strict=False):
                d = self._logprob_dict(entry)
                c.logprobs.append(d)
                c.cumulative_logprob = (c.cumulative_logprob or 0.0) + d[tok].logprob
        stop_hit = False
        if stop_str is not None:
            c.finish_reason, c.stop_reason = "stop", stop_str
            stop_hit = not out.finished
        if out.finished and c.finish_reason is None:
            c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
        return stop_hit

    @staticmethod
    def _detokenize(detok: IncrementalDetokenizer, out: EngineCoreOutput) -> tuple[int, str | None]:
        """Feed the step's tokens to the detokenizer; return how many to keep and the stop string.

        A step may bring several tokens (accepted drafts, a committed diffusion canvas). When a
        stop string completes inside them, the tokens after the one that completed it are
        dropped, so token ids, logprobs and usage match a one-token-per-step run.
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

    def make_output(self, request_id: str) -> RequestOutput | None:
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        completions = [
            CompletionOutput(
                index=c.index,
                text=c.detok.output_text if c.detok is not None else "",
                token_ids=list(c.token_ids),
                cumulative_logprob=c.cumulative_logprob,
                logprobs=c.logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in parent.children.values()
        ]
        return RequestOutput(
            request_id=request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=all(c.finish_reason is not None for c in parent.children.values()),
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
        )
