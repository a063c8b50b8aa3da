"""Soak: diffusion requests (DiffusionGemma) preempted and resumed over and over in a tight KV
pool, with the canvas spans checked at every step and every output compared with its solo run.

    python benchmarks/soak_diffusion.py                # >= 1,000 preemption/resume cycles
    python benchmarks/soak_diffusion.py --quick        # a smoke run

Model: a tiny random DiffusionGemma (2 layers: sliding + full attention, MoE, vocabulary 64,
canvas 16), fp32. The pool holds 8 blocks of 16 tokens (one request at max_model_len = 128),
so concurrent requests preempt each other (recompute) all the time. A steady stream of requests
(`--in-flight` queued or running) with prompts of 1..50 tokens (every fifth one sharing a
32-token prefix, so resumes and admissions hit the prefix cache), max_tokens from 1 to the end
of the context, a few seeds, EOS ignored or not, stop token ids, min_tokens; now and then the
prefix cache is reset with the running requests preempted, and with `--abort-prob` requests are
aborted at random (queued, preempted, mid-prefill or mid-canvas).

A preemption/resume cycle: a request preempted (its KV dropped) and later resumed (recomputed);
both are counted from the scheduler outputs the runner executes (a pass-through tap), and checked
against the engine's preemption metric (every preemption is followed by a resume, unless the
request is aborted while preempted). Canvas-span anomalies, checked at every step:
- a scheduled canvas has exactly the length its request expects (the canvas length, or the tail
  clipped at max_model_len), equal to the tokens scheduled: never split, never padded with the
  AR spec-decode padding (-1), every token in the vocabulary;
- the canvas starts right after the request's committed tokens (as seen in its outputs): no
  token lost or duplicated;
- a resumed request carries exactly its committed tokens (prompt + outputs so far), and runs a
  prefill before any canvas; a new request never has a canvas; a prefill chunk never runs past
  the committed tokens; a request whose committed tokens are all computed is never scheduled
  without its canvas;
- the scheduler's and the pool's bookkeeping between steps (`state_problems`).
Every request finishes with the length its parameters imply (or a valid stop) and equals its
solo run (same seed, alone, on a big pool; run as soon as it finished, so that the soak keeps
nothing per finished request); at the end no block is leaked. RSS is sampled
every `--rss-every` requests (drift within `--max-drift` %).

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

from soak_common import (  # noqa: E402
    RssSampler,
    StepTap,
    build_tiny_diffusion_gemma,
    end_problems,
    mib,
    print_table,
    run_alone,
    state_problems,
)
from soak_diffusion_checks import (  # noqa: E402
    VOCAB,
    Report,
    Tracked,
    check_batch,
    check_finished,
    check_sampled,
)

from impasto.config import EngineArgs  # noqa: E402
from impasto.core import RequestStatus  # noqa: E402
from impasto.core.outputs import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from impasto.engine.engine import LLMEngine  # noqa: E402
from impasto.outputs import RequestOutput  # noqa: E402
from impasto.sampling_params import SamplingParams  # noqa: E402

SHARED_PREFIX = [5] * 32


class DiffusionSoak:
    def __init__(self, args: argparse.Namespace, model: Path) -> None:
        self.args = args
        self.engine = self.make_engine(
            model,
            num_gpu_blocks_override=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=True,
        )
        self.sched = self.engine.scheduler
        self.canvas = self.sched.config.num_speculative_tokens  # the canvas length
        self.max_model_len = args.max_model_len
        self.rng = random.Random(args.seed)
        self.report = Report()
        # Only live requests are kept: each finished one is compared with its solo run at
        # once, so what the soak holds stays flat and the RSS it measures is the engines'.
        self.live: dict[str, Tracked] = {}
        self.ended = 0
        # The reference: one sequence at a time, a big pool, no prefix cache.
        self.solo = self.make_engine(
            model, num_gpu_blocks_override=64, max_num_seqs=1, enable_prefix_caching=False
        )
        self.solo_seconds = 0.0
        self.solo_checked = 0
        self.tap = StepTap(self.engine.runner, self._observe, self._after)

    def make_engine(self, model: Path, **kwargs: Any) -> LLMEngine:
        a = self.args
        return LLMEngine(
            EngineArgs(
                model=str(model),
                skip_tokenizer_init=True,
                dtype="float32",
                device="cpu",
                seed=a.seed,
                block_size=16,
                max_model_len=a.max_model_len,
                diffusion_config={"max_denoising_steps": a.denoising_steps},
                num_threads=1,
                disable_log_stats=True,
                **kwargs,
            )
        )

    # -- the workload --------------------------------------------------------------------------
    def new_request(self, i: int) -> tuple[list[int], SamplingParams]:
        rng = self.rng
        n = rng.choice([1, 15, 16, 17, 33, rng.randrange(1, 50)])
        prompt = [rng.randrange(3, VOCAB) for _ in range(n)]
        if i % 5 == 0 and i:  # shared prefixes: prefix-cache hits on resume and on admission
            prompt = SHARED_PREFIX + prompt[:17]
        kw: dict[str, Any] = dict(max_tokens=rng.choice([1, 9, 16, 31, 64, None, None, None]))
        kw["seed"] = rng.choice([0, 1, 2, None])
        kw["ignore_eos"] = rng.random() < 0.8
        if rng.random() < 0.15:
            kw["stop_token_ids"] = [rng.randrange(3, VOCAB)]
        if rng.random() < 0.15:
            kw["min_tokens"] = rng.randrange(0, min(kw["max_tokens"] or 40, 40) + 1)
        return prompt, SamplingParams(**kw)

    # -- per step: canvas spans ----------------------------------------------------------------
    def _observe(self, so: SchedulerOutput) -> None:
        check_batch(
            so,
            self.report,
            canvas_len=self.canvas,
            max_model_len=self.max_model_len,
            live=self.live,
        )

    def _after(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        check_sampled(so, out, self.report)

    # -- the run -------------------------------------------------------------------------------
    def take(self, outputs: list[RequestOutput]) -> None:
        for delta in outputs:
            t = self.live.get(delta.request_id)
            if t is None:
                self.report.anomaly(f"output for unknown request {delta.request_id}")
                continue
            c = delta.outputs[0]
            t.tokens += c.token_ids
            if delta.finished:
                t.finish_reason = c.finish_reason
                self.live.pop(delta.request_id)
                self.ended += 1
                check_finished(delta.request_id, t, self.report, self.max_model_len)
                self.compare_with_solo(delta.request_id, t)

    def run(self) -> tuple[RssSampler, float]:
        args, engine, r = self.args, self.engine, self.report
        rss = RssSampler(warmup=args.warmup)
        added = next_sample = 0
        t0 = time.perf_counter()
        while added < args.requests or self.live:
            while added < args.requests and len(self.live) < args.in_flight:
                prompt, params = self.new_request(added)
                rid = engine.add_request(None, {"prompt_token_ids": prompt}, params)
                self.live[rid] = Tracked(prompt, params)
                added += 1
            if self.live and self.rng.random() < args.abort_prob:
                self.abort(self.rng.choice(sorted(self.live)))
            if self.rng.random() < args.reset_prob:
                engine.reset_prefix_cache(reset_running_requests=True)
            self.take(engine.step())
            for problem in state_problems(engine):
                r.anomaly(f"step {r.steps}: {problem}")
            if self.ended >= next_sample:
                mem = rss.sample(self.ended)
                next_sample += args.rss_every
                if not args.quiet:
                    print(f"  {self.ended} requests done, {r.resumes} resumes, RSS {mib(mem)}")
            if self.live and not engine.has_unfinished_requests():
                for rid in list(self.live):
                    r.anomaly(f"request {rid} lost: no output, nothing unfinished")
                    self.live.pop(rid)
                    self.ended += 1
        wall = time.perf_counter() - t0
        rss.sample(self.ended)
        return rss, wall

    def abort(self, rid: str) -> None:
        request = self.sched.requests.get(rid)
        if request is not None and request.status == RequestStatus.PREEMPTED:
            self.report.aborted_preempted += 1
        self.engine.abort_request(rid)
        self.live.pop(rid)
        self.ended += 1
        self.report.aborted += 1

    def compare_with_solo(self, rid: str, t: Tracked) -> None:
        """Run the request again, alone, on the solo engine: the same tokens expected."""
        t0 = time.perf_counter()
        tokens = run_alone(self.solo, t.prompt, t.params)
        self.solo_checked += 1
        if tokens != t.tokens:
            self.report.mismatches.append(
                f"{rid} (prompt of {len(t.prompt)}, {t.params}, {t.preemptions} "
                f"preemptions): soak {t.tokens} != solo {tokens}"
            )
        self.solo_seconds += time.perf_counter() - t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--min-cycles", type=int, default=1000, help="fail below this many cycles")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-flight", type=int, default=12, help="requests kept queued or running")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=9, help="KV pool, null block included")
    ap.add_argument("--denoising-steps", type=int, default=3, help="max per canvas")
    ap.add_argument("--abort-prob", type=float, default=0.0, help="abort one request, per step")
    ap.add_argument("--reset-prob", type=float, default=0.002, help="prefix-cache reset, per step")
    ap.add_argument("--rss-every", type=int, default=50, help="requests between RSS samples")
    ap.add_argument("--warmup", type=int, default=150, help="requests before the RSS reference")
    ap.add_argument("--max-drift", type=float, default=5.0, help="allowed RSS drift, percent")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--quick", action="store_true", help="a smoke run: a few dozen requests")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.min_cycles, args.warmup, args.rss_every = 30, 15, 10, 10
        args.max_drift = max(args.max_drift, 25.0)  # too short for a steady state
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_diffusion_gemma(Path(tmp, "dg"), seed=args.seed + 1)
        soak = DiffusionSoak(args, model)
        rss, wall = soak.run()
        leaked, total, problems = end_problems(soak.engine)
        for problem in problems:
            soak.report.anomaly(problem)
    r = soak.report
    metrics = {m.name: m.value for m in soak.engine.get_metrics()}
    if int(metrics["impasto:num_preemptions"]) != r.preemptions:
        r.anomaly(f"{r.preemptions} preemptions seen, the metric says {metrics}")
    if r.resumes + r.aborted_preempted != r.preemptions:  # every other one resumed
        r.anomaly(
            f"{r.preemptions} preemptions, {r.resumes} resumes, {r.aborted_preempted} aborted"
        )
    cycles = r.resumes
    drift_ok = abs(rss.drift_pct) <= args.max_drift
    ok = (
        not r.anomalies
        and not r.canvas_anomalies
        and not r.mismatches
        and leaked == 0
        and drift_ok
        and cycles >= args.min_cycles
    )
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.finish_reasons.items()))
    print_table(
        "Diffusion preemption/resume soak (DiffusionGemma, recompute preemption)",
        [
            ("requests", f"{args.requests} ({reasons}, aborted {r.aborted})"),
            ("engine steps", r.steps),
            ("preemption/resume cycles", f"{cycles} (minimum {args.min_cycles})"),
            ("  one-token resumes", r.one_token_resumes),
            ("canvas steps checked", f"{r.canvas_steps} ({r.clipped_canvases} clipped)"),
            ("canvas-span anomalies", len(r.canvas_anomalies)),
            ("other anomalies", len(r.anomalies)),
            ("solo-run mismatches", f"{len(r.mismatches)} of {soak.solo_checked}"),
            ("leaked blocks", f"{leaked} of {total}"),
            ("RSS warm-up -> end", f"{mib(rss.warm)} -> {mib(rss.end)} (max {mib(rss.max)})"),
            ("RSS drift", f"{rss.drift_pct:+.2f} % (max {rss.max_drift_pct:+.2f} %)"),
            ("wall time", f"{wall:.0f} s (solo runs {soak.solo_seconds:.0f} s of it)"),
            ("result", "PASS" if ok else "FAIL"),
        ],
    )
    for message in r.canvas_anomalies[:20] + r.anomalies[:20] + r.mismatches[:5]:
        print("  !", message)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
