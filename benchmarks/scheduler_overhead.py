"""Host overhead of one engine step: schedule() + update_from_output(), decode steps.

Prints µs per step and per request at 1, 16, 64 and 256 running requests (prompt 128 tokens,
block 16, prefix caching on, fake outputs). When vLLM is importable in this Python, its v1
scheduler runs the same trace and the table shows the ratio (impasto / vLLM, lower is better).

    python benchmarks/scheduler_overhead.py [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from impasto.core.outputs import ModelRunnerOutput
from impasto.testing import make_requests, make_scheduler

SIZES = [1, 16, 64, 256]
PROMPT = 128


def bench_impasto(num_reqs: int, steps: int) -> float:
    sched = make_scheduler(
        max_num_seqs=256,
        max_num_batched_tokens=8192 * 4,
        max_model_len=2048,
        enable_prefix_caching=True,
    )
    for r in make_requests(num_reqs, num_tokens=PROMPT, max_tokens=10**6, ignore_eos=True):
        sched.add_request(r)

    def step() -> None:
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, ModelRunnerOutput(ids, [[7]] * len(ids)))

    return _time(step, steps)


_VLLM_FAILED = False


def bench_vllm(num_reqs: int, steps: int) -> float | None:  # pragma: no cover - optional peer
    global _VLLM_FAILED
    if _VLLM_FAILED:
        return None
    try:
        from vllm_driver import make_vllm_step  # type: ignore[import-not-found]
    except ImportError:
        try:
            from benchmarks.vllm_driver import make_vllm_step
        except Exception:
            return None
    try:
        step = make_vllm_step(num_reqs, PROMPT)
    except Exception as e:  # vLLM not importable or API drift: report and skip
        print(f"# vLLM scheduler unavailable: {type(e).__name__}: {e}")
        _VLLM_FAILED = True
        return None
    return _time(step, steps)


def _time(step: Callable[[], None], steps: int) -> float:
    step()  # prefill step, not timed
    for _ in range(10):
        step()
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"{'running':>8} {'impasto µs/step':>16} {'µs/req':>8} {'vLLM µs/step':>13} {'ratio':>6}")
    for n in SIZES:
        ours = bench_impasto(n, args.steps)
        theirs = bench_vllm(n, args.steps)
        peer = f"{theirs:13.1f}" if theirs else f"{'n/a':>13}"
        ratio = f"{ours / theirs:6.2f}" if theirs else f"{'':>6}"
        print(f"{n:>8} {ours:16.1f} {ours / n:8.2f} {peer} {ratio}")


if __name__ == "__main__":
    main()
