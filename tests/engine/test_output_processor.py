"""OutputProcessor: several tokens in one step (accepted drafts, a committed canvas) are cut
at the token that completes a stop string, with their logprobs; outputs are deltas whose sum is
the whole completion, and a request of N tokens costs O(N) work."""

from __future__ import annotations

from impasto.core.outputs import EngineCoreOutput
from impasto.engine.detokenizer import IncrementalDetokenizer
from impasto.engine.output_processor import OutputProcessor
from impasto.outputs import RequestOutput
from impasto.sampling_params import SamplingParams
from tests.engine.test_detokenizer import TEXT, byte_level


def _track(stop: list[str], chunk: int):
    tok = byte_level()
    ids = tok.encode(TEXT, add_special_tokens=False)
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=len(ids), stop=stop, logprobs=0)
    proc.add("r", None, [], params)
    hit_at, acc = None, None
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        logprobs = [{t: (-0.5, 1)} for t in part]
        last = start + chunk >= len(ids)
        core = EngineCoreOutput("r", part, last, "length" if last else None, new_logprobs=logprobs)
        deltas, stopped = proc.process([core])
        for d in deltas:
            acc = RequestOutput.start(d) if acc is None else acc.add(d) or acc
        if stopped:
            hit_at = start
            break
    assert acc is not None and acc.finished
    return ids, acc.outputs[0], hit_at


def test_tokens_after_the_stop_string_are_dropped():
    stop, tok = "lease", byte_level()
    trimmed = 0
    for chunk in range(2, 10):
        ids, out, hit_at = _track([stop], chunk)
        assert hit_at is not None and out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == TEXT[: TEXT.index(stop)]
        # The kept tokens are the shortest prefix whose text contains the stop string.
        n = len(out.token_ids)
        assert stop in tok.decode(ids[:n]) and stop not in tok.decode(ids[: n - 1])
        assert list(out.token_ids) == ids[:n]
        assert len(out.logprobs) == n and out.cumulative_logprob == -0.5 * n
        trimmed += n < min(hit_at + chunk, len(ids))
    assert trimmed > 0  # some chunkings put the stop mid-step


def test_chunked_and_token_by_token_agree():
    for stop in ["op he", "世界 s", "🎉"]:
        _, one, _ = _track([stop], chunk=1)
        _, many, _ = _track([stop], chunk=9)
        assert (one.text, list(one.token_ids)) == (many.text, list(many.token_ids))


def test_no_stop_string_keeps_every_token():
    ids, out, hit_at = _track([], chunk=5)
    assert hit_at is None and list(out.token_ids) == ids


def test_deltas_carry_only_what_is_new_and_cost_o_n(monkeypatch):
    """Stream N tokens one per step: every delta carries that step's token only, the texts
    sum to the final text, and the detokenizer decodes O(N) tokens in total (counted)."""
    decoded = []
    real = IncrementalDetokenizer._decode
    monkeypatch.setattr(
        IncrementalDetokenizer,
        "_decode",
        lambda self, ids: decoded.append(len(ids)) or real(self, ids),
    )
    tok = byte_level()
    ids = tok.encode(TEXT * 8, add_special_tokens=False)
    n = len(ids)
    proc = OutputProcessor(tok)
    proc.add("r", None, [1, 2, 3], SamplingParams(max_tokens=n, stop=["never there"], logprobs=1))
    texts, tokens, logprobs = [], 0, 0
    for i, t in enumerate(ids):
        last = i == n - 1
        core = EngineCoreOutput(
            "r", [t], last, "length" if last else None, new_logprobs=[{t: (-1.0, 1)}]
        )
        (delta,), _ = proc.process([core])
        (c,) = delta.outputs
        assert c.token_ids == [t] and len(c.logprobs) == 1
        texts.append(c.text)
        tokens += len(c.token_ids)
        logprobs += len(c.logprobs)
    assert tokens == logprobs == n and "".join(texts) == tok.decode(ids)
    assert sum(decoded) <= 40 * n  # a window of a few tokens per token, never the whole text
    assert not proc.parents  # finished requests are dropped


def test_streamed_text_never_holds_a_partial_stop_string():
    """Held back while it could still become the stop string, released when it does not."""
    tok = byte_level()
    proc = OutputProcessor(tok)
    proc.add("r", None, [], SamplingParams(max_tokens=100, stop=["STOP"]))
    streamed = []
    for piece in ["ab S", "T", "x ", "STO", "P tail"]:
        ids = tok.encode(piece, add_special_tokens=False)
        deltas, stopped = proc.process([EngineCoreOutput("r", ids)])
        streamed += [c.text for d in deltas for c in d.outputs]
        joined = "".join(streamed)
        assert not any(joined.endswith("STOP"[:k]) for k in range(1, 4)), joined
        if stopped:
            break
    assert stopped == ["r"] and "".join(streamed) == "ab STx "
    (d,) = deltas
    assert d.finished and d.outputs[0].finish_reason == "stop"
