"""The error types of admission: a bad value of a named parameter, and a full waiting queue.

Every check that refuses a request or an engine argument raises `InvalidParameterError`, which
is a `ValueError` (callers that only know `ValueError` keep working) carrying the offending
parameter's name in `param`. The HTTP layer maps it to a 400 with that `param`, in one place.

`QueueFullError` is the one refusal that is not the request's fault: the scheduler's waiting
queue is at its bound (`max_waiting_requests`), nothing was enqueued, and the same request may
succeed later (the HTTP layer answers 503 with `Retry-After`).

Pure Python, importable from every layer; both types are picklable across processes.
"""

from __future__ import annotations


class InvalidParameterError(ValueError):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple:  # picklable across processes with its param
        return (type(self), (self.param, self.message))


class QueueFullError(RuntimeError):
    """Admission refused because the waiting queue is full; nothing was enqueued.

    `num_requested` counts scheduler requests (a request with `n` choices counts as `n`);
    `num_waiting` is the queue length seen at the refusal, `limit` its bound."""

    def __init__(self, num_requested: int, num_waiting: int, limit: int) -> None:
        super().__init__(
            f"The server is overloaded: the waiting queue is full ({num_waiting} waiting, "
            f"limit {limit}; this request needs {num_requested} "
            f"slot{'s' if num_requested != 1 else ''}). Retry later."
        )
        self.num_requested, self.num_waiting, self.limit = num_requested, num_waiting, limit
        self.message = str(self)

    def __reduce__(self) -> tuple:
        return (type(self), (self.num_requested, self.num_waiting, self.limit))
