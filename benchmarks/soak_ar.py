"""Soak: autoregressive decoding with speculation, random sampling parameters, random aborts,
shared prefixes and a tight KV pool, through `LLMEngine` (add_request / step / abort_request).

    python benchmarks/soak_ar.py                       # 10,000 requests, draft-model drafts
    python benchmarks/soak_ar.py --speculator ngram    # n-gram drafts instead
    python benchmarks/soak_ar.py --policy priority --padding --long-prefill-threshold 16
    python benchmarks/soak_ar.py --quick               # a smoke run (100 requests)

Model: a tiny random Llama (fp32) with a word-level tokenizer over the same vocabulary (so stop
strings and bad words work), and for `--speculator draft` a smaller random Llama as the draft.
A steady stream of requests (`--in-flight` kept queued or running) with random prompts (mostly
a shared prefix + a random tail, so prefix caching hits; some repeated motifs, so n-gram drafts
hit) and random `SamplingParams` (temperature, top_p, top_k, min_p, seed, n, stop strings, stop
token ids, bad words, logit bias, allowed tokens, max_tokens, min_tokens, logprobs, prompt
logprobs, penalties). Between steps, requests are aborted at random: some mid-prefill, some
mid-decode, some while queued or preempted; now and then the prefix cache is reset with the
running requests preempted. Options switch on the priority policy (random priorities: running
requests preempted for higher-priority ones), uniform spec-decode padding and a long-prefill cap.

Checked, and counted as anomalies:
- every `--check-every` steps: the KV pool's integrity (`check_integrity`), the scheduler's
  bookkeeping (running / waiting / block tables / output processor agree), and on every step
  the scheduled batch (budget, drafts at most K, padding only as placeholders, no preempted
  request scheduled, a resumed request carries exactly its committed tokens); every preemption
  is followed by a resume unless the request is aborted while preempted;
- every finished completion: a valid finish reason (stop / length), its length within
  max_tokens / max_model_len, logprobs and prompt logprobs of the right shape, tokens allowed by
  allowed_token_ids / bad_words; no output after an abort, no request lost;
- at the end: no unfinished request, the prefix cache resets and every block is free (nothing
  leaked), the runner and the output processor hold nothing;
- RSS (after a gc) every `--rss-every` requests: drift from warm-up to end within
  `--max-drift` %;
- losslessness: a sample of greedy, non-aborted requests (half of it preempted ones) run
  again, each alone, on an engine without speculation: identical tokens.

The soak keeps only live requests and a bounded sample of finished ones, so the RSS it
measures is the engine's.

Prints a summary table; the exit status is 0 only if every check held.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_ar_checks import (  # noqa: E402
    LosslessSample,
    Report,
    Tracked,
    check_batch,
    check_end,
    check_finished,
    check_state,
)
from soak_ar_workload import Workload  # noqa: E402
from soak_common import (  # noqa: E402
    RssSampler,
    StepTap,
    build_tiny_llama,
    mib,
    print_table,
)

from impasto.config import EngineArgs  # noqa: E402
from impasto.core import RequestStatus  # noqa: E402
from impasto.core.outputs import SchedulerOutput  # noqa: E402
from impasto.engine.engine import LLMEngine  # noqa: E402
from impasto.outputs import RequestOutput  # noqa: E402

# Relative abort rates per phase of the request (see `ArSoak.maybe_abort`).
ABORT_WEIGHTS = {
    "queued": 0.5,
    "preempted": 1.0,
    "mid-prefill": 4.0,
    "mid-recompute": 4.0,
    "mid-decode": 1.0,
}


def make_engine(args: argparse.Namespace, model: Path, **kwargs: Any) -> LLMEngine:
    """An fp32 CPU engine on one thread with the soak's seed and shapes, plus `kwargs`."""
    return LLMEngine(
        EngineArgs(
            model=str(model),
            dtype="float32",
            device="cpu",
            seed=args.seed,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            num_threads=1,
            disable_log_stats=True,
            **kwargs,
        )
    )


class ArSoak:
    def __init__(self, args: argparse.Namespace, model: Path, draft: Path | None) -> None:
        self.args = args
        spec: dict[str, Any]
        if draft is not None:
            spec = dict(method="draft_model", model=str(draft), num_speculative_tokens=args.k)
        else:
            spec = dict(
                method="ngram",
                num_speculative_tokens=args.k,
                prompt_lookup_min=1,
                prompt_lookup_max=3,
            )
        spec["uniform_spec_decode_padding"] = args.padding
        self.engine = make_engine(
            args,
            model,
            num_gpu_blocks_override=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=True,
            long_prefill_token_threshold=args.long_prefill_threshold,
            scheduling_policy=args.policy,
            speculative_config=spec,
        )
        self.sched = self.engine.scheduler
        self.k = args.k
        self.rng = random.Random(args.seed)
        self.workload = Workload(random.Random(args.seed + 1), args.max_model_len)
        self.report = Report()
        # Only live requests are kept (and a bounded sample of finished ones): what the soak
        # itself holds stays flat, so the RSS it measures is the engine's.
        self.live: dict[str, Tracked] = {}  # user request id -> request, until it ends
        self.ended = 0
        self.child_of: dict[str, tuple[str, int]] = {}  # scheduler id -> (request id, index)
        # A sample of finished greedy requests (n=1), preempted or not, for the lossless check.
        self.greedy_sample = LosslessSample(args.lossless_sample, random.Random(args.seed + 2))
        self.tap = StepTap(self.engine.runner, self._observe)

    # -- per step: the scheduled batch ---------------------------------------------------------
    def _observe(self, so: SchedulerOutput) -> None:
        budget = self.sched.config.max_num_batched_tokens
        check_batch(
            so, self.report, budget=budget, k=self.k, live=self.live, child_of=self.child_of
        )

    # -- admission, aborts, outputs ------------------------------------------------------------
    def add(self) -> None:
        prompt, params = self.workload.prompt(), self.workload.params()
        priority = self.rng.randrange(3) if self.args.policy == "priority" else 0
        rid = self.engine.add_request(None, {"prompt_token_ids": prompt}, params, priority=priority)
        children = self.engine.output_processor.child_ids(rid)
        self.live[rid] = Tracked(prompt, params, children)
        for i, child in enumerate(children):
            self.child_of[child] = (rid, i)

    def _phase(self, tracked: Tracked) -> str | None:
        states = [self.sched.requests.get(c) for c in tracked.children]
        states = [s for s in states if s is not None]
        if not states:
            return None
        s = states[0]
        if s.status == RequestStatus.PREEMPTED:
            return "preempted"
        if s.status == RequestStatus.WAITING:
            return "queued"
        if s.num_computed_tokens >= s.num_tokens - 1:  # only the last sampled token is new
            return "mid-decode"
        # A prompt (or, after a preemption, prompt + outputs) not all in the cache yet.
        return "mid-prefill" if s.num_output_tokens == 0 else "mid-recompute"

    def maybe_abort(self) -> None:
        """Per phase present, abort one of its requests with probability `abort_prob` times
        the phase's weight: prefills are short-lived, so they are aimed at harder."""
        by_phase: dict[str, list[str]] = {}
        for rid, t in self.live.items():
            phase = self._phase(t)
            if phase is not None:
                by_phase.setdefault(phase, []).append(rid)
        for phase, rids in sorted(by_phase.items()):
            if self.rng.random() >= self.args.abort_prob * ABORT_WEIGHTS[phase]:
                continue
            rid = self.rng.choice(rids)
            for child in self.live[rid].children:
                request = self.sched.requests.get(child)
                if request is not None and request.status == RequestStatus.PREEMPTED:
                    self.report.aborted_preempted += 1
            self.engine.abort_request(rid)
            self.end(rid).aborted = phase
            self.report.aborts[phase] += 1

    def end(self, rid: str) -> Tracked:
        """Forget a request that finished or was aborted."""
        tracked = self.live.pop(rid)
        for child in tracked.children:
            del self.child_of[child]
        self.ended += 1
        return tracked

    def take(self, outputs: list[RequestOutput]) -> int:
        """Fold the step's deltas in; returns how many requests finished."""
        finished = 0
        for delta in outputs:
            rid = delta.request_id
            tracked = self.live.get(rid)
            if tracked is None:
                self.report.anomaly(f"output for request {rid}, aborted or unknown")
                continue
            if tracked.output is None:
                tracked.output = RequestOutput.start(delta)
            else:
                tracked.output.add(delta)
            if delta.finished:
                self.end(rid)
                check_finished(rid, tracked, self.report, self.args.max_model_len)
                self.greedy_sample.keep(tracked)
                finished += 1
        return finished

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> tuple[RssSampler, float]:
        args, engine = self.args, self.engine
        rss = RssSampler(warmup=args.warmup)
        added = 0
        next_sample = 0
        t0 = time.perf_counter()
        while added < args.requests or engine.has_unfinished_requests() or self.live:
            while added < args.requests and len(self.live) < args.in_flight:
                self.add()
                added += 1
            self.maybe_abort()
            if self.rng.random() < args.reset_prob:
                engine.reset_prefix_cache(reset_running_requests=True)
            self.take(engine.step())
            ended = self.ended
            if self.report.steps % args.check_every == 0:
                check_state(engine, self.report, self.live)
            if ended >= next_sample:
                mem = rss.sample(ended)
                next_sample += args.rss_every
                if not args.quiet:
                    print(f"  {ended} requests ended, {self.report.steps} steps, RSS {mib(mem)}")
            if not engine.has_unfinished_requests() and self.live and added >= args.requests:
                for rid in list(self.live):
                    self.report.anomaly(f"request {rid} lost: no output, nothing unfinished")
                    self.end(rid)
        wall = time.perf_counter() - t0
        rss.sample(self.ended)
        return rss, wall

    # -- losslessness --------------------------------------------------------------------------
    def lossless(self, model: Path) -> None:
        solo = make_engine(
            self.args,
            model,
            num_gpu_blocks_override=256,  # a big pool: never preempted
            max_num_seqs=1,
            enable_prefix_caching=False,
        )
        self.greedy_sample.check(solo, self.report)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--speculator", choices=["draft", "ngram"], default="draft")
    ap.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    ap.add_argument("--padding", action="store_true", help="uniform spec-decode padding")
    ap.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    ap.add_argument("--long-prefill-threshold", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-flight", type=int, default=16, help="requests kept queued or running")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=40)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=48, help="KV pool (tight: preemption)")
    ap.add_argument("--abort-prob", type=float, default=0.015, help="per step and phase")
    ap.add_argument("--reset-prob", type=float, default=0.002, help="prefix-cache reset, per step")
    ap.add_argument("--check-every", type=int, default=1, help="steps between state checks")
    ap.add_argument("--rss-every", type=int, default=250, help="requests between RSS samples")
    ap.add_argument("--warmup", type=int, default=1000, help="requests before the RSS reference")
    ap.add_argument("--max-drift", type=float, default=5.0, help="allowed RSS drift, percent")
    ap.add_argument("--lossless-sample", type=int, default=200)
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 100 requests")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.rss_every = 100, 40, 20
        args.lossless_sample = 6
        args.max_drift = max(args.max_drift, 25.0)  # too short for a steady state
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(Path(tmp, "target"), seed=args.seed)
        draft = None
        if args.speculator == "draft":
            draft = build_tiny_llama(
                Path(tmp, "draft"), seed=args.seed + 1, hidden_size=16, num_layers=1
            )
        soak = ArSoak(args, model, draft)
        rss, wall = soak.run()
        end = check_end(soak.engine, soak.report)
        t_lossless = time.perf_counter()
        soak.lossless(model)
        t_lossless = time.perf_counter() - t_lossless
    r = soak.report
    metrics = {m.name: m.value for m in soak.engine.get_metrics()}
    drift_ok = abs(rss.drift_pct) <= args.max_drift
    ok = not r.anomalies and not r.mismatches and end["leaked"] == 0 and drift_ok
    hit = metrics["impasto:prefix_cache_hits"] / max(metrics["impasto:prefix_cache_queries"], 1)
    drafted = metrics["impasto:spec_decode_num_draft_tokens"]
    accepted = metrics["impasto:spec_decode_num_accepted_tokens"]
    aborts = ", ".join(f"{k} {v}" for k, v in sorted(r.aborts.items()))
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.finish_reasons.items()))
    variant = f"{args.speculator}, K={args.k}, {args.policy}"
    variant += ", uniform padding" * args.padding
    if args.long_prefill_threshold:
        variant += f", long prefills capped at {args.long_prefill_threshold}"
    print_table(
        f"AR + speculative decoding soak ({variant})",
        [
            ("requests", f"{args.requests} ({sum(r.aborts.values())} aborted: {aborts})"),
            ("completions finished", reasons),
            ("engine steps", r.steps),
            ("state checks", r.checks),
            (
                "preemptions / resumes",
                f"{r.preemptions} / {r.resumes} (+ {r.aborted_preempted} aborted while preempted)",
            ),
            ("prefix-cache hit rate", f"{100 * hit:.1f} %"),
            ("drafts accepted", f"{int(accepted)} / {int(drafted)}"),
            ("anomalies", len(r.anomalies)),
            (
                "lossless mismatches",
                f"{len(r.mismatches)} of {r.lossless_checked} greedy requests "
                f"({r.lossless_preempted} preempted), {t_lossless:.0f} s",
            ),
            ("leaked blocks", f"{end['leaked']} of {end['total']}"),
            ("RSS warm-up -> end", f"{mib(rss.warm)} -> {mib(rss.end)} (max {mib(rss.max)})"),
            ("RSS drift", f"{rss.drift_pct:+.2f} % (max {rss.max_drift_pct:+.2f} %)"),
            ("wall time", f"{wall:.0f} s"),
            ("result", "PASS" if ok else "FAIL"),
        ],
    )
    for message in r.anomalies[:20] + r.mismatches[:5]:
        print("  !", message)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
