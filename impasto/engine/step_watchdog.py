"""The step watchdog: a deadline on each model step, so a hung step fails its requests instead
of hanging the engine.

The model step runs on one worker thread (a daemon: a step that never returns cannot keep
the process alive at exit). `run()` waits for it up to the timeout. A step that misses it is
*timed out*: the caller fails that step's requests, and the worker thread still owns the
runner until the step returns. Invariants:

- At most one step runs at a time: `run()` refuses while a timed-out step is still running
  (`stuck()`), so the runner's state is never touched by two threads.
- A timed-out step's late result is discarded (its requests were already failed); the caller
  learns it ended through `wait_released()` and repairs the runner then.
- A step stuck for longer than `timeout_s + grace_s` will not come back in any useful time:
  `stuck_for()` tells the caller, which declares the engine dead (the process exits non-zero
  so a supervisor restarts it; Python cannot kill a thread).

With no timeout the step runs on the caller's thread, with no overhead at all.

With a timeout, everything that touches the model should run on the worker thread, setup
included (`run_untimed`): GNU OpenMP wakes the thread team of any thread other than the first
one to run a parallel region through the kernel, ~50-75 us per region against ~15-20 us
(measured), so once the caller's thread had run one (loading the model, say), every matmul,
norm and attention kernel of every step paid that wake-up (a 1.5B model decoding at batch 1:
25.8 against 33.7 tok/s). Keeping the caller's thread free of parallel regions keeps the
worker's team the only one.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class EngineDeadError(RuntimeError):
    """The engine cannot go on (a model step hung past any hope): restart the process."""


class StepTimeoutError(Exception):
    """The step missed its deadline; `stack` is where the worker thread was at that moment."""

    def __init__(self, timeout_s: float, stack: str) -> None:
        super().__init__(f"the model step did not finish within {timeout_s:g} s")
        self.timeout_s = timeout_s
        self.stack = stack


class StepWatchdog(Generic[T]):
    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[tuple[Callable[[], T], Future[T]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._hung: Future[T] | None = None  # a timed-out step still running
        self._hung_since = 0.0

    def run_untimed(self, fn: Callable[[], R]) -> R:
        """fn() on the thread steps run on, without a deadline (model setup)."""
        if self.timeout_s is None:
            return fn()
        future: Future[R] = Future()
        self._jobs.put((fn, future))  # type: ignore[arg-type]  # the worker only forwards it
        self._start()
        return future.result()

    def run(self, fn: Callable[[], T]) -> T:
        """fn() under the deadline. Raises StepTimeoutError (the step goes on in the
        background: see the module docstring), or whatever fn raised."""
        if self.timeout_s is None:
            return fn()
        if self._hung is not None:
            raise RuntimeError("a timed-out step still holds the runner")
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        self._start()
        try:
            return future.result(self.timeout_s)
        except TimeoutError:
            if future.done():  # finished right at the deadline
                return future.result()
            self._hung, self._hung_since = future, time.monotonic()
            raise StepTimeoutError(self.timeout_s, self._worker_stack()) from None

    def stuck(self) -> bool:
        return self._hung is not None

    def stuck_for(self) -> float:
        """Seconds since the running step missed its deadline (0 when none did)."""
        return time.monotonic() - self._hung_since if self._hung is not None else 0.0

    def wait_released(self, max_wait_s: float) -> bool:
        """Wait up to max_wait_s for a timed-out step to end; True once none is running."""
        hung = self._hung
        if hung is None:
            return True
        try:
            hung.exception(max_wait_s)  # its result or error is discarded
        except TimeoutError:
            return False
        self._hung = None
        return True

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="impasto-step", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(e)

    def _worker_stack(self) -> str:
        thread = self._thread
        frame = sys._current_frames().get(thread.ident) if thread and thread.ident else None
        return "".join(traceback.format_stack(frame)) if frame is not None else "(unavailable)"
