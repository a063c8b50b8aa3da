"""What the AR soak (`soak_ar.py`) checks: the engine's bookkeeping between steps and at the
end, the scheduled batch of every step, every finished completion, and losslessness (a sample
of greedy requests run again, alone, without speculation), with the soak's record of requests
(`Tracked`) and of findings (`Report`).

Invariants: the checks between and during steps and per completion only read the engine and
the soak's records, and change nothing but counts (in the `Report`, and a request's preemptions
in its `Tracked`); only the end check acts on the engine (one more step and a prefix-cache
reset, `end_problems`), and the losslessness check runs its requests on an engine of its own.
Anomalies are kept up to 1000 (the last slot then shows the latest one), so a broken run cannot
exhaust memory.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from soak_ar_workload import EOS, VOCAB
from soak_common import end_problems, run_alone, state_problems

from impasto.core.admission import PADDING_TOKEN_ID
from impasto.core.outputs import SchedulerOutput
from impasto.engine.engine import LLMEngine
from impasto.outputs import RequestOutput
from impasto.sampling_params import SamplingParams


@dataclass
class Tracked:
    """What the soak knows about one user request."""

    prompt: list[int]
    params: SamplingParams
    children: list[str]  # scheduler ids, in completion order
    output: RequestOutput | None = None
    aborted: str | None = None  # the phase it was aborted in
    preemptions: int = 0


@dataclass
class Report:
    """What the soak found and counted; it passes only with no anomaly and no mismatch."""

    anomalies: list[str] = field(default_factory=list)
    preemptions: int = 0
    resumes: int = 0
    steps: int = 0
    checks: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    aborts: Counter[str] = field(default_factory=Counter)
    aborted_preempted: int = 0  # scheduler requests aborted while preempted: never resumed
    lossless_checked: int = 0
    lossless_preempted: int = 0
    mismatches: list[str] = field(default_factory=list)

    def anomaly(self, message: str) -> None:
        if len(self.anomalies) < 1000:
            self.anomalies.append(message)
        else:
            self.anomalies[-1] = f"... and more; last: {message}"


# -- every `--check-every` steps and at the end: the engine's bookkeeping -----------------------


def check_state(engine: LLMEngine, r: Report, live: Mapping[str, Tracked]) -> None:
    """Between steps: the scheduler's and the pool's bookkeeping (`state_problems`), and the
    output processor tracking exactly the soak's live requests."""
    r.checks += 1
    for problem in state_problems(engine):
        r.anomaly(f"step {r.steps}: {problem}")
    if set(engine.output_processor.parents) != set(live):
        extra = set(engine.output_processor.parents) ^ set(live)
        r.anomaly(f"step {r.steps}: output processor and soak disagree on {extra}")


def check_end(engine: LLMEngine, r: Report) -> dict[str, int]:
    """After the last request: nothing held anywhere, every block free, every preemption
    resumed unless aborted while preempted; the leaked and the usable blocks."""
    leaked, total, problems = end_problems(engine)
    for problem in problems:
        r.anomaly(problem)
    if r.resumes + r.aborted_preempted != r.preemptions:  # every other one resumed
        r.anomaly(
            f"{r.preemptions} preemptions: {r.resumes} resumed, {r.aborted_preempted} aborted"
        )
    return {"leaked": leaked, "total": total}


# -- per step: the scheduled batch -------------------------------------------------------------


def committed(
    child: str, live: Mapping[str, Tracked], child_of: Mapping[str, tuple[str, int]]
) -> list[int] | None:
    """A live scheduler request's committed tokens (prompt + its completion's outputs so far),
    None once its user request ended."""
    rid, index = child_of[child]
    tracked = live.get(rid)
    if tracked is None:
        return None
    if tracked.output is None:
        return list(tracked.prompt)
    for c in tracked.output.outputs:
        if c.index == index:
            return tracked.prompt + c.token_ids
    return list(tracked.prompt)


def check_batch(
    so: SchedulerOutput,
    r: Report,
    *,
    budget: int,
    k: int,
    live: Mapping[str, Tracked],
    child_of: Mapping[str, tuple[str, int]],
) -> None:
    """One step's scheduled batch: within the token `budget`, at most `k` drafts per request
    (padding only as placeholders), no request preempted by this step scheduled, a resumed
    request carrying exactly its committed tokens. Counts the step, preemptions and resumes."""
    bad = r.anomaly
    total = sum(so.num_scheduled_tokens.values())
    if total != so.total_num_scheduled_tokens or total > budget:
        bad(f"step {r.steps}: {total} tokens scheduled, budget {budget}")
    for rid, n in so.num_scheduled_tokens.items():
        spec = so.scheduled_spec_decode_tokens.get(rid, [])
        if n <= 0 or len(spec) >= n or len(spec) > k:
            bad(f"step {r.steps}: {rid} scheduled {n} tokens with {len(spec)} drafts")
        if any(t != PADDING_TOKEN_ID and not 0 <= t < VOCAB for t in spec):
            bad(f"step {r.steps}: {rid} drafts out of vocabulary: {spec}")
    cached = so.scheduled_cached_reqs
    pairs = zip(cached.req_ids, cached.resumed_from_preemption, strict=True)
    resumed = {rid for rid, again in pairs if again}
    for rid in so.preempted_req_ids:
        r.preemptions += 1
        # Preempted by this step's scheduling: not scheduled. Preempted before the step
        # (a prefix-cache reset of the running requests): it may resume at once.
        if rid in so.num_scheduled_tokens and rid not in resumed:
            bad(f"step {r.steps}: preempted {rid} is scheduled")
        parent = child_of.get(rid)
        if parent and parent[0] in live:
            live[parent[0]].preemptions += 1
    for i, rid in enumerate(cached.req_ids):
        if not cached.resumed_from_preemption[i]:
            continue
        r.resumes += 1
        want = committed(rid, live, child_of)
        got = cached.resumed_token_ids.get(rid)
        # The output processor may hold back nothing here: a stop string finishes the
        # request, so a resumed request's committed tokens are all in its outputs.
        if want is not None and got != want:
            bad(f"step {r.steps}: {rid} resumed with {got}, committed {want}")
        n = so.num_scheduled_tokens[rid]
        if got is not None and cached.num_computed_tokens[i] + n > len(got) + k:
            bad(f"step {r.steps}: resumed {rid} scheduled past its tokens")
    r.steps += 1


# -- per completion ----------------------------------------------------------------------------


def check_finished(rid: str, t: Tracked, r: Report, max_model_len: int) -> None:
    """A finished request: n completions, each with a valid finish reason, a length within
    max_tokens / max_model_len, only allowed tokens, and logprobs of the right shape."""
    p, out = t.params, t.output
    assert out is not None
    bad = r.anomaly
    if len(out.outputs) != p.n:
        bad(f"{rid}: {len(out.outputs)} completions, n={p.n}")
    if p.prompt_logprobs is not None:
        plp = out.prompt_logprobs
        if plp is None or len(plp) != len(t.prompt) or plp[0] is not None:
            bad(f"{rid}: prompt logprobs of {len(plp or [])} positions, {len(t.prompt)}")
    room = max_model_len - len(t.prompt)
    for c in out.outputs:
        reason = c.finish_reason
        r.finish_reasons[str(reason)] += 1
        n = len(c.token_ids)
        if reason not in ("stop", "length"):
            bad(f"{rid}/{c.index}: finish reason {reason!r}")
            continue
        cap = min(p.max_tokens or room, room)
        if n > cap or (reason == "length" and n != cap):
            bad(f"{rid}/{c.index}: {n} tokens, {reason}, cap {cap}")
        if reason == "stop" and isinstance(c.stop_reason, int | type(None)):
            if n < p.min_tokens:
                bad(f"{rid}/{c.index}: stopped by a token after {n} < min_tokens")
            if c.stop_reason is None and (p.ignore_eos or not c.token_ids[-1:] == [EOS]):
                bad(f"{rid}/{c.index}: EOS stop without an EOS")
        if any(not 0 <= tok < VOCAB for tok in c.token_ids):
            bad(f"{rid}/{c.index}: token out of vocabulary")
        if p.allowed_token_ids and set(c.token_ids) - set(p.allowed_token_ids):
            bad(f"{rid}/{c.index}: tokens outside allowed_token_ids")
        if p.bad_words_token_ids:
            banned = {w[0] for w in p.bad_words_token_ids if len(w) == 1}
            if banned & set(c.token_ids):
                bad(f"{rid}/{c.index}: a bad word was generated")
        if p.logprobs is not None:
            lps = c.logprobs or []
            ok = len(lps) == n and all(
                tok in lp and len(lp) <= p.logprobs + 1
                for tok, lp in zip(c.token_ids, lps, strict=False)
            )
            if not ok:
                bad(f"{rid}/{c.index}: {len(lps)} logprob entries for {n} tokens")


# -- losslessness ------------------------------------------------------------------------------


class LosslessSample:
    """Reservoir samples (`size` each) of finished greedy n=1 requests, one reservoir for
    preempted requests and one for the others: (prompt, params, tokens, preemptions). Only
    the sample is kept, so what the soak holds stays flat."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.size = size
        self.rng = rng
        self.seen = [0, 0]
        self.reservoirs: list[list[tuple[list[int], SamplingParams, list[int], int]]] = [[], []]

    def keep(self, t: Tracked) -> None:
        if not t.params.is_greedy or t.params.n != 1 or t.output is None:
            return
        which = int(t.preemptions > 0)
        self.seen[which] += 1
        reservoir, size = self.reservoirs[which], self.size
        item = (t.prompt, t.params, list(t.output.outputs[0].token_ids), t.preemptions)
        if len(reservoir) < size:
            reservoir.append(item)
        else:
            j = self.rng.randrange(self.seen[which])
            if j < size:
                reservoir[j] = item

    def check(self, solo: LLMEngine, r: Report) -> None:
        """Run `size` sampled requests (up to half of them preempted ones) again, each alone,
        on `solo` (an engine without speculation): the same tokens expected."""
        half = self.size // 2
        preempted, others = self.reservoirs[1], self.reservoirs[0]
        sample = preempted[:half]
        sample += others[: self.size - len(sample)]
        for prompt, params, got, preemptions in sample:
            tokens = run_alone(solo, prompt, params)
            r.lossless_checked += 1
            r.lossless_preempted += preemptions > 0
            if got != tokens:
                r.mismatches.append(
                    f"prompt {prompt} params {params}: speculative {got} != solo {tokens}"
                )
