"""What the step watchdog costs per engine step: the hand-off of each step to its worker
thread and back, measured on an empty step (so it is all overhead), against no watchdog.

    python benchmarks/step_watchdog.py

Compare the figure with a decode step of the model you serve (e.g. ~10-20 ms for the default
model on 2 cores): the watchdog's share is overhead / step time.
"""

from __future__ import annotations

import statistics
import time

from impasto.engine.step_watchdog import StepWatchdog

CALLS = 20_000
ROUNDS = 7


def per_call_us(timeout_s: float | None) -> list[float]:
    watchdog: StepWatchdog[None] = StepWatchdog(timeout_s)
    step = lambda: None  # noqa: E731
    for _ in range(1000):  # the worker thread started and warm
        watchdog.run(step)
    out = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            watchdog.run(step)
        out.append((time.perf_counter() - t0) / CALLS * 1e6)
    return out


def main() -> None:
    print(f"{'watchdog':>12} {'min us/step':>12} {'median':>8}")
    for label, timeout in (("off", None), ("on (300 s)", 300.0)):
        us = per_call_us(timeout)
        print(f"{label:>12} {min(us):12.1f} {statistics.median(us):8.1f}")


if __name__ == "__main__":
    main()
