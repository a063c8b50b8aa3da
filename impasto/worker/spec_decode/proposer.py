"""The proposer interface, and the per-request draft-length policy shared by all proposers.

After each step the runner hands the proposer a `StepResult` (what was scheduled and what was
committed, per request) and gets back the next step's drafts, one list per request (empty: no
drafts). Drafts are only proposed for requests that sampled this step: a prefill chunk has no
next token yet.

Back-off: per request, the policy keeps a decayed estimate of the per-draft acceptance rate
`alpha` (a geometric model: draft i is accepted with probability alpha^i) and proposes the
largest k with `alpha^k > tau` (times a safety factor: near break-even a gain is noise, a
loss is not), where `tau` is the relative cost of one more verified token at the current batch
size. When even one draft does not pay, it stops drafting and probes with one
draft after a cool-down that doubles while probes keep failing.

Token cost: a decode step's time is close to linear in its query rows, t = a + b * rows, with a
(weights streamed once, per-step host work) and b (per-row compute) depending on the hardware,
the model and the batch. `StepCostModel` fits a and b online, by decayed least squares over the
decode steps this engine actually ran, so c = b / a is measured rather than assumed: drafting k
for n requests pays while alpha > tau = c n / (1 + c n). Until the rows have varied enough to
show a slope, the prior `TOKEN_COST` stands in.

Goodput gate: what a verified token costs depends on the hardware and the batch (a matmul
kernel may switch at some row count), so the proposer also measures committed tokens per second
of steps with and without drafts, per batch-size bucket, and turns drafting off for a bucket
where it is measured to lose; one step in `_EXPLORE` runs the other way to keep both measured.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from impasto.config.speculative import SpeculativeConfig
from impasto.worker.input_batch import InputBatch
from impasto.worker.request_state import RequestState, SpecPolicyState

_DECAY = 0.8  # weight of the past in the acceptance estimate, per verification step
_PRIOR = (4.0, 5.0)  # (accepted, trials): a new request starts at alpha = 0.8
_MAX_COOLDOWN = 64
# Cost of one more query token relative to a 1-token decode step of one request. Verifying
# costs little while the forward is bound by reading the weights (small batches on CPU or GPU).
TOKEN_COST = 0.04
_COST_DECAY = 0.98  # weight of the past in the step-time fit, per decode step
_MIN_ROW_SPREAD = 1.0  # variance of rows below which the fit cannot see a slope
_COST_RANGE = (0.002, 1.0)  # a fitted token cost outside this is noise, clipped
_EXPLORE = 16  # steps per exploration step of the goodput gate
_RATE_DECAY = 0.9
_MAX_GAP_S = 2.0  # a longer gap between steps is idle time, not step time
_MIN_SAMPLES = 8  # steps of each kind measured before the gate may close
_MARGIN = 0.9  # close only when drafting is clearly slower (timings on shared CPUs are noisy)


@dataclass
class StepCostModel:
    """Decayed least-squares fit of decode step time against query rows: t = a + b * rows."""

    w: float = 0.0  # decayed number of observations; the rest are decayed sums
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    fitted: float | None = None  # the last token cost the data could tell

    def observe(self, rows: int, seconds: float) -> None:
        d = _COST_DECAY
        self.w = d * self.w + 1.0
        self.sx = d * self.sx + rows
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + rows * rows
        self.sxy = d * self.sxy + rows * seconds
        if self.w < _MIN_SAMPLES:
            return
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var < _MIN_ROW_SPREAD:
            return  # rows barely varied lately: keep the last estimate
        b = (self.sxy / self.w - mx * my) / var
        a = my - b * mx
        if a > 0:
            lo, hi = _COST_RANGE
            self.fitted = min(max(b / a, lo), hi)

    def token_cost(self) -> float:
        """Cost of one more query row relative to a one-row step (c = b / a)."""
        return TOKEN_COST if self.fitted is None else self.fitted


@dataclass
class GoodputGate:
    """Per batch-size bucket: decayed committed-tokens/second of plain and drafting steps."""

    rates: dict[tuple[int, bool], float] = field(default_factory=dict)
    samples: dict[tuple[int, bool], int] = field(default_factory=dict)
    steps: int = 0

    def observe(self, bucket: int, drafted: bool, committed: int, seconds: float | None) -> None:
        """`seconds`: the step's time, None for steps that say nothing about decoding."""
        self.steps += 1
        if seconds is None or committed == 0:
            return
        rate = committed / seconds
        key = (bucket, drafted)
        old = self.rates.get(key)
        self.samples[key] = self.samples.get(key, 0) + 1
        self.rates[key] = rate if old is None else _RATE_DECAY * old + (1 - _RATE_DECAY) * rate

    def allow_drafts(self, bucket: int) -> bool:
        plain, spec = self.rates.get((bucket, False)), self.rates.get((bucket, True))
        explore = self.steps % _EXPLORE == 0
        measured = min(self.samples.get((bucket, d), 0) for d in (False, True)) >= _MIN_SAMPLES
        if not measured or spec is None or plain is None or spec >= _MARGIN * plain:
            return not explore  # drafting wins (or is not measured yet): plain now and then
        return explore  # drafting loses: a drafting step now and then


@dataclass
class StepResult:
    """One executed step, per scheduled request (all lists aligned with `req_ids`)."""

    req_ids: list[str]
    rows: np.ndarray  # [B] rows in the persistent batch
    start: np.ndarray  # [B] num_computed_tokens at the start of the step
    num_sched: np.ndarray  # [B] tokens scheduled (drafts included)
    sampled: list[list[int]]  # committed this step: accepted drafts + bonus; [] = prefill chunk
    drafts: list[list[int]]  # drafts verified this step (-1 = padding placeholder)


class Proposer(ABC):
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.gate = GoodputGate()
        self.cost = StepCostModel()
        self._last_step: float | None = None

    @abstractmethod
    def propose(self, batch: InputBatch, step: StepResult) -> list[list[int]]:
        """Drafts for the next step, one list per request of `step` (same order)."""

    # -- draft length ---------------------------------------------------------------------------
    def num_drafts(self, batch: InputBatch, step: StepResult) -> list[int]:
        """How many drafts each request may get next step (0 for prefill chunks, for requests
        about to hit max_tokens / max_model_len, and while backing off). Also feeds the
        acceptance of this step's drafts into the policy."""
        n = len(step.req_ids)
        bucket = 1 << max(n - 1, 0).bit_length()  # 1, 2, 4, 8, ...
        drafted = any(t >= 0 for d in step.drafts for t in d)
        now = time.perf_counter()
        seconds = None if self._last_step is None else now - self._last_step
        self._last_step = now
        if seconds is not None and (seconds > _MAX_GAP_S or not all(step.sampled)):
            seconds = None  # idle gaps and steps with prefill chunks say nothing about decoding
        if seconds is not None:
            self.cost.observe(int(step.num_sched.sum()), seconds)
        self.gate.observe(bucket, drafted, sum(map(len, step.sampled)), seconds)
        disable = self.config.disable_by_batch_size
        if disable is not None and batch.num_reqs >= disable:
            return [0] * n
        gate_open = not self.config.acceptance_backoff or self.gate.allow_drafts(bucket)
        c = self.cost.token_cost()
        tau = c * n / (1.0 + c * n)
        out = []
        for b in range(n):
            if not step.sampled[b]:
                out.append(0)
                continue
            state = batch.states[int(step.rows[b])]
            real = sum(1 for t in step.drafts[b] if t >= 0)
            k = self._room(state)
            if self.config.acceptance_backoff:
                k = min(k, _policy(state, real, len(step.sampled[b]) - 1, tau, self.k))
            if not gate_open:
                k = 0
            out.append(max(k, 0))
        return out

    def _room(self, state: RequestState) -> int:
        """Drafts beyond max_tokens or max_model_len would be thrown away: k + 1 tokens can be
        committed next step, and the bonus token needs a position below max_model_len."""
        k = min(self.k, self.max_model_len - state.num_tokens - 1)
        max_tokens = state.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - len(state.output_token_ids) - 1)
        return k


# Drafts must beat the break-even by this factor: near break-even the gain is within the
# estimates' noise while a loss is certain (each probe and each rejected row costs time).
_SAFETY = 1.3


def _policy(state: RequestState, drafted: int, accepted: int, tau: float, k_max: int) -> int:
    """Update the request's acceptance estimate with this step's result; return its next k."""
    policy = state.resident.spec_policy
    if policy is None:
        policy = state.resident.spec_policy = SpecPolicyState(*_PRIOR)
    acc, trials, cooldown, idle = policy.accepted, policy.trials, policy.cooldown, policy.idle
    if drafted > 0:
        # Geometric model: `accepted` successes, then one failure unless all were accepted.
        acc = _DECAY * acc + accepted
        trials = _DECAY * trials + accepted + (accepted < drafted)
    alpha = acc / trials
    bar = min(tau * _SAFETY, 0.95)
    k = 0
    while k < k_max and alpha ** (k + 1) > bar:
        k += 1
    if k == 0:
        if drafted > 0:  # a failed probe (or the estimate just fell): wait longer next time
            cooldown = min(max(2 * cooldown, 4), _MAX_COOLDOWN)
            idle = 0
        idle += 1
        if idle >= cooldown:
            k, idle = 1, 0  # probe
    else:
        cooldown = idle = 0
    policy.accepted, policy.trials, policy.cooldown, policy.idle = acc, trials, cooldown, idle
    return k
