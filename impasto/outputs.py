"""User-facing results, shaped like vLLM's `RequestOutput` / `CompletionOutput`.

The engine emits *deltas*: each `RequestOutput` of `LLMEngine.step()` carries, per completion
that changed, only the text, token ids and logprobs produced since the previous output of that
request (`cumulative_logprob` and the finish fields are the running values). `add()` folds a
delta into an accumulated output, which is what `LLM.generate` returns. A streamed request of N
tokens thus costs O(N) host work in total, never a copy of what was already sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Append a delta of the same completion (same index)."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def add(self, delta: RequestOutput) -> None:
        """Fold a delta of the same request into this output (completions matched by index;
        an index not seen before is added)."""
        by_index = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                mine = CompletionOutput(c.index, "", [], logprobs=None)
                self.outputs.append(mine)
                by_index[c.index] = mine
            mine.add(c)
        self.outputs.sort(key=lambda c: c.index)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.finished = delta.finished

    @classmethod
    def start(cls, delta: RequestOutput) -> RequestOutput:
        """A fresh accumulated output from the first delta of a request."""
        out = cls(delta.request_id, delta.prompt, delta.prompt_token_ids, [])
        out.add(delta)
        return out
