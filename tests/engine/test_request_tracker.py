"""RequestTracker: several tokens in one step (accepted drafts, a committed canvas) are cut
at the token that completes a stop string, with their logprobs."""

from __future__ import annotations

from impasto.core.outputs import EngineCoreOutput
from impasto.engine.request_tracker import RequestTracker
from impasto.sampling_params import SamplingParams
from tests.engine.test_detokenizer import TEXT, byte_level


def _track(stop: list[str], chunk: int):
    tok = byte_level()
    ids = tok.encode(TEXT, add_special_tokens=False)
    tracker = RequestTracker(tok)
    params = SamplingParams(max_tokens=len(ids), stop=stop, logprobs=0)
    tracker.add("r", None, [], params)
    hit_at = None
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        logprobs = [{t: (-0.5, 1)} for t in part]
        if tracker.update(EngineCoreOutput("r", part, new_logprobs=logprobs)):
            hit_at = start
            break
    return ids, tracker.make_output("r").outputs[0], hit_at


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
