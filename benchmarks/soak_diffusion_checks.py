"""What the diffusion soak (`soak_diffusion.py`) checks: the canvas spans of every scheduled
batch, what the runner reports for each canvas, and every finished request's length and stop,
with the soak's record of requests (`Tracked`) and of findings (`Report`), and the tiny
DiffusionGemma's vocabulary (`VOCAB`, `EOS`).

Invariants: the checks only read the scheduler and runner outputs and the soak's records, and
change nothing but counts (in the `Report`, and a request's preemptions in its `Tracked`).
Canvas-span anomalies and the others are kept apart, up to 1000 of each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from impasto.core.outputs import ModelRunnerOutput, SchedulerOutput
from impasto.sampling_params import SamplingParams

VOCAB = 64
EOS = 1


@dataclass
class Tracked:
    """What the soak knows about one live request."""

    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # committed outputs, from the deltas
    finish_reason: str | None = None
    preemptions: int = 0


@dataclass
class Report:
    """What the soak found and counted; it passes only with no anomaly of either kind and no
    mismatch (and enough preemption/resume cycles)."""

    canvas_anomalies: list[str] = field(default_factory=list)  # per-step canvas-span checks
    anomalies: list[str] = field(default_factory=list)  # everything else
    mismatches: list[str] = field(default_factory=list)
    steps: int = 0
    canvas_steps: int = 0
    one_token_resumes: int = 0
    clipped_canvases: int = 0
    preemptions: int = 0
    resumes: int = 0
    aborted: int = 0
    aborted_preempted: int = 0  # aborted while preempted: a cycle that never resumes
    finish_reasons: Counter[str] = field(default_factory=Counter)

    def anomaly(self, message: str, canvas: bool = False) -> None:
        found = self.canvas_anomalies if canvas else self.anomalies
        if len(found) < 1000:
            found.append(message)


# -- per step: canvas spans --------------------------------------------------------------------


def committed(rid: str, live: Mapping[str, Tracked]) -> list[int] | None:
    """A live request's committed tokens (prompt + outputs so far), None if it is not live."""
    t = live.get(rid)
    return None if t is None else t.prompt + t.tokens


def check_batch(
    so: SchedulerOutput,
    r: Report,
    *,
    canvas_len: int,
    max_model_len: int,
    live: Mapping[str, Tracked],
) -> None:
    """One step's scheduled batch: every canvas of its expected length (`canvas_len`, or the
    tail clipped at `max_model_len`) right after its request's committed tokens, resumes
    carrying exactly those and prefilling before any canvas, no prefill past them, no
    preempted request scheduled. Counts the step, canvases, preemptions and resumes."""

    def bad(message: str) -> None:
        r.anomaly(message, canvas=True)

    step = r.steps
    r.steps += 1
    spec = so.scheduled_spec_decode_tokens
    for new in so.scheduled_new_reqs:
        n = so.num_scheduled_tokens[new.req_id]
        if new.req_id in spec:
            bad(f"step {step}: new request {new.req_id} scheduled with a canvas")
        if new.num_computed_tokens + n > len(new.prompt_token_ids):
            bad(f"step {step}: new request {new.req_id} prefills past its prompt")
    cached = so.scheduled_cached_reqs
    resumed = set()
    for i, rid in enumerate(cached.req_ids):
        num_computed, n = cached.num_computed_tokens[i], so.num_scheduled_tokens[rid]
        tokens = committed(rid, live)
        if tokens is None:
            bad(f"step {step}: {rid} scheduled, but it is not a live request")
            continue
        canvas = spec.get(rid)
        if cached.resumed_from_preemption[i]:
            resumed.add(rid)
            r.resumes += 1
            r.one_token_resumes += n == 1
            got = cached.resumed_token_ids.get(rid)
            if got != tokens:
                bad(f"step {step}: {rid} resumed with {got}, committed {tokens}")
            if canvas is not None:
                bad(f"step {step}: resumed {rid} scheduled with a canvas")
            if num_computed % 16 or num_computed >= len(tokens):
                bad(f"step {step}: resumed {rid} hit {num_computed} of {len(tokens)}")
        if canvas is None:
            if num_computed + n > len(tokens):
                bad(f"step {step}: {rid} prefills {n} past its {len(tokens)} tokens")
            if num_computed >= len(tokens):
                bad(f"step {step}: {rid} scheduled without its canvas")
            continue
        r.canvas_steps += 1
        want = min(canvas_len, max_model_len - num_computed)
        r.clipped_canvases += want < canvas_len
        if not n == len(canvas) == want:
            bad(f"step {step}: {rid} canvas of {len(canvas)}, {n} scheduled, expected {want}")
        if any(not 0 <= tok < VOCAB for tok in canvas):
            bad(f"step {step}: {rid} canvas holds non-vocabulary tokens (padding?)")
        if num_computed != len(tokens):
            bad(f"step {step}: {rid} canvas at {num_computed}, {len(tokens)} committed")
    for rid in so.preempted_req_ids:
        r.preemptions += 1
        if rid in live:
            live[rid].preemptions += 1
        if rid in so.num_scheduled_tokens and rid not in resumed:
            bad(f"step {step}: preempted {rid} is scheduled")


def check_sampled(so: SchedulerOutput, out: ModelRunnerOutput, r: Report) -> None:
    """A canvas step reports nothing sampled (denoise) or the whole canvas (commit)."""
    index = out.index_of()
    for rid, canvas in so.scheduled_spec_decode_tokens.items():
        i = index.get(rid)
        sampled = out.sampled_token_ids[i] if i is not None else None
        if sampled is None or len(sampled) not in (0, len(canvas)):
            r.anomaly(f"{rid}: {sampled} sampled from a canvas of {len(canvas)}", True)


# -- per finished request ----------------------------------------------------------------------


def expected_len(t: Tracked, max_model_len: int) -> int:
    """The tokens a request ends with when it runs to its length limit."""
    limit = max_model_len - len(t.prompt)
    return min(t.params.max_tokens or limit, limit)


def check_finished(rid: str, t: Tracked, r: Report, max_model_len: int) -> None:
    """A finished request: stopped by length at exactly its expected length, or by a stop
    token (or EOS, unless ignored) after min_tokens and within it."""
    p = t.params
    r.finish_reasons[str(t.finish_reason)] += 1
    want, n = expected_len(t, max_model_len), len(t.tokens)
    if t.finish_reason == "length":
        if n != want:
            r.anomaly(f"{rid}: {n} tokens, length, expected {want}")
    elif t.finish_reason == "stop":
        stops = set(p.stop_token_ids or []) | (set() if p.ignore_eos else {EOS})
        if not (n <= want and t.tokens and t.tokens[-1] in stops and n >= p.min_tokens):
            r.anomaly(f"{rid}: stopped after {n} tokens ({t.tokens[-1:]}), cap {want}")
    else:
        r.anomaly(f"{rid}: finish reason {t.finish_reason!r}")
