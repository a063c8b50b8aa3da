"""Log-probabilities as the OpenAI API (and vLLM's extensions) shape them.

An engine logprob entry is `(token id, logprob, rank, decoded text)`; a position holds the
chosen token's entry and the top-N, sorted by rank. Renderings:
- completions (`logprobs: N`): parallel lists `tokens`, `token_logprobs`, `top_logprobs`,
  `text_offset`; with `echo`, the prompt's positions come first, the first one with null
  logprobs (nothing predicts it), and offsets run on through the completion, as in vLLM;
- chat (`logprobs: true, top_logprobs: N`): a `content` list of tokens with their top-N;
- vLLM's `prompt_logprobs: N`: one `{token id: {logprob, rank, decoded_token}}` per prompt
  position (the first null), on completion choices and chat responses.
`N = -1` means the whole vocabulary (capped by `--max-logprobs`). Logprobs below -9999 are
reported as -9999 (JSON has no -inf). With `return_tokens_as_token_ids`, tokens are rendered
`token_id:<id>` (for text that does not decode on its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from impasto.engine import ipc
from impasto.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

_MIN_LOGPROB = -9999.0
Entries = list[ipc.LogprobEntry]


def clamp_logprob(lp: float) -> float:
    return lp if lp > _MIN_LOGPROB else _MIN_LOGPROB


class TokenText:
    """How a token is shown: its decoded text (or `token_id:<id>`)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, token_id: int, decoded: str | None = None) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        if decoded is not None:
            return decoded
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id])
        return str(token_id)


def _shown(entries: Entries, top_n: int) -> Entries:
    """The chosen token and the top-`top_n` (-1: every entry the engine sent)."""
    return entries if top_n < 0 else entries[: top_n + 1]


def completion_logprobs(
    text_of: TokenText,
    token_ids: Sequence[int],
    positions: Sequence[Entries | None],
    top_n: int,
    offset: int = 0,
) -> CompletionLogprobs:
    """Completions' logprobs for `token_ids`, `positions[i]` the entries of token i (None: a
    position nothing predicts, the prompt's first). `offset`: text offset of the first."""
    lp = CompletionLogprobs()
    for tok, entries in zip(token_ids, positions, strict=False):
        chosen = None if entries is None else next((e for e in entries if e[0] == tok), None)
        text = text_of(tok, chosen[3] if chosen else None)
        lp.tokens.append(text)
        lp.text_offset.append(offset)
        offset += len(text)
        if entries is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        lp.token_logprobs.append(clamp_logprob(chosen[1]) if chosen else None)
        top = {text_of(e[0], e[3]): clamp_logprob(e[1]) for e in _shown(entries, top_n)}
        lp.top_logprobs.append(top)
    return lp


def chat_logprobs(
    text_of: TokenText, token_ids: Sequence[int], positions: Sequence[Entries], top_n: int
) -> ChatLogprobs:
    content = []
    for tok, entries in zip(token_ids, positions, strict=False):
        chosen = next((e for e in entries if e[0] == tok), (tok, _MIN_LOGPROB, 0, None))
        text = text_of(tok, chosen[3])
        top = [
            TopLogprob(
                token=(s := text_of(e[0], e[3])),
                logprob=clamp_logprob(e[1]),
                bytes=list(s.encode()),
            )
            for e in (entries if top_n < 0 else entries[:top_n])
        ]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=clamp_logprob(chosen[1]),
                bytes=list(text.encode()),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


def prompt_logprobs(
    text_of: TokenText,
    positions: Sequence[Entries | None] | None,
    prompt_ids: Sequence[int],
    top_n: int,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` field: per position `{token id: {logprob, rank,
    decoded_token}}` holding the prompt token and the top-`top_n` (-1: all the engine sent),
    the first position null."""
    if positions is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for tok, entries in zip(prompt_ids, positions, strict=False):
        if entries is None:
            out.append(None)
            continue
        out.append(
            {
                str(e[0]): {
                    "logprob": clamp_logprob(e[1]),
                    "rank": e[2],
                    "decoded_token": text_of(e[0], e[3]),
                }
                for e in entries
                if e[0] == tok or top_n < 0 or 1 <= e[2] <= top_n
            }
        )
    return out
