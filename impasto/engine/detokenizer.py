"""Incremental detokenization with stop strings, on top of any HF tokenizer.

Decoding a token alone is wrong for most tokenizers (byte-level BPE splits characters across
tokens; SentencePiece/WordPiece render a token depending on its neighbours). So each new token is
decoded inside a short *window*: `window[:read]` is context already turned into text
(`prefix_text`), `window[read:]` the unread tokens. The new text is
`decode(window)[len(prefix_text):]`. When it ends in U+FFFD the last character may be incomplete
(a UTF-8 sequence cut between tokens): only the part before the trailing U+FFFD run is committed,
and the window grows until the character completes. Otherwise all of it is committed and the
window slides: the unread tokens become the next context. Per-token cost: two decodes of a window
of a few tokens, independent of the sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_FFFD = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded as context for the first output tokens
_MAX_WINDOW = 16  # a window of text-less tokens slides anyway past this length
_MAX_PENDING = 4  # unread tokens after which a pending window is split (invalid byte runs)


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, finding stop strings as text appears.

    Invariants: `output_text` never ends inside a character (a partial UTF-8 sequence is held
    back until it completes or the request finishes); once a stop string is found the text is cut
    there (after it if include_stop_str_in_output) and later updates are ignored; with no stop
    string, the final text equals `tokenizer.decode(output_ids)` for byte-level tokenizers and an
    empty prompt (with a prompt, the first token is rendered in the prompt's context, e.g. with
    its leading space).
    """

    def __init__(
        self,
        tokenizer: Any,  # transformers.PreTrainedTokenizerBase
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_reason: str | None = None
        self.finished = False
        self._text = ""
        self._streamed = 0  # chars of _text already returned by get_delta_text()
        self._window = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._committed = 0  # chars of the window's new text already in _text

    @property
    def output_text(self) -> str:
        return self._text

    def update(
        self, new_token_ids: Sequence[int], stop_terminated: bool = False, finished: bool = False
    ) -> str | None:
        """Append tokens; return the stop string found in the new text, if any.

        stop_terminated: the last token is a stop token (EOS / stop_token_ids); its text is left
        out unless include_stop_str_in_output. finished: the request ends with these tokens, so
        a held-back partial character is flushed (as U+FFFD, like `decode` renders it).
        """
        if self.finished:
            return None
        ids = list(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output:
            ids = ids[:-1]
        start = len(self._text)
        for token_id in ids:
            self._step(token_id)
        if stop_terminated or finished:
            self._flush()
            self.finished = True
        stop = self._find_stop(start)
        if stop is not None:
            self.stop_reason = stop
            self.finished = True
        return stop

    def get_delta_text(self) -> str:
        """Text produced since the previous call, for streaming. Until the request finishes, a
        tail that could be the start of a stop string is held back, so no partial stop string
        (which would later be cut) is ever streamed."""
        end = len(self.streamable_text)
        delta = self._text[self._streamed : end] if end > self._streamed else ""
        self._streamed = max(self._streamed, end)
        return delta

    @property
    def streamable_text(self) -> str:
        """output_text minus the held-back tail (cumulative streaming)."""
        held = 0 if self.finished else self._held_back()
        return self._text[: len(self._text) - held]

    # -- decoding -----------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _step(self, token_id: int) -> None:
        self._window.append(token_id)
        new = self._decode(self._window)[len(self._prefix_text) :]
        if new.endswith(_FFFD):
            if len(self._window) - self._read >= _MAX_PENDING and self._split_pending():
                new = self._decode(self._window)
            stable = len(new.rstrip(_FFFD))
            if stable > self._committed:
                self._text += new[self._committed : stable]
                self._committed = stable
            return
        self._text += new[self._committed :]
        # Slide: the unread tokens become the context of the next token, unless they rendered
        # nothing (skipped special tokens), which would leave the next token without context.
        if new or len(self._window) > _MAX_WINDOW:
            self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        self._committed = 0

    def _split_pending(self) -> bool:
        """A long pending window (invalid bytes, not just a cut character): find a recent token
        boundary where decoding is additive, commit the text before it and restart the window
        there with no context. Additive = decode(head) + decode(tail) == decode(head + tail),
        which for lossy UTF-8 means no byte after the boundary can still change the head."""
        full = self._decode(self._window)
        for j in range(len(self._window) - 1, max(self._read, len(self._window) - 4), -1):
            head, tail = self._decode(self._window[:j]), self._decode(self._window[j:])
            if not tail or head + tail != full or len(head) < len(self._prefix_text):
                continue
            done = len(head) - len(self._prefix_text)  # new-text chars before the boundary
            if done > self._committed:
                self._text += head[len(self._prefix_text) + self._committed :]
                self._committed = done
            self._committed -= done  # now relative to the tail
            self._window, self._read, self._prefix_text = self._window[j:], 0, ""
            return True
        return False

    def _flush(self) -> None:
        """Commit whatever the window holds, incomplete characters included."""
        new = self._decode(self._window)[len(self._prefix_text) :]
        self._text += new[self._committed :]
        self._committed = len(new)

    # -- stop strings -------------------------------------------------------------------------
    def _find_stop(self, start: int) -> str | None:
        """The stop string that completes first in the text appended after `start` (earliest
        end, then earliest start), as a character-by-character check would see it: the result
        does not depend on how tokens were grouped into updates. Cuts the text there."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            idx = self._text.find(s, max(0, start - len(s) + 1))
            if idx >= 0 and (best is None or (idx + len(s), idx) < best[:2]):
                best = (idx + len(s), idx, s)
        if best is None:
            return None
        _, idx, s = best
        self._text = self._text[: idx + len(s) if self.include_stop_str_in_output else idx]
        return s

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._text)), held, -1):
                if self._text.endswith(s[:n]):
                    held = n
                    break
        return held
