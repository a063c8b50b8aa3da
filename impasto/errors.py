"""The one error type of admission: a bad value of a named parameter.

Every check that refuses a request or an engine argument raises `InvalidParameterError`, which
is a `ValueError` (callers that only know `ValueError` keep working) carrying the offending
parameter's name in `param`. The HTTP layer maps it to a 400 with that `param`, in one place.
Pure Python, importable from every layer.
"""

from __future__ import annotations


class InvalidParameterError(ValueError):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message

    def __reduce__(self) -> tuple:  # picklable across processes with its param
        return (type(self), (self.param, self.message))
