"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, one place.

Invariants:
- every failure a client can cause is a 4xx with this body; 5xx only for engine failures,
  overload (503 with `Retry-After`) and timeouts (504);
- error messages are bounded (a huge invalid body must not produce a huge error);
- a 500 never shows internals (exception types, messages, tracebacks, file paths): its body is
  "Internal server error (error id X)" and the details are logged under that id. A 400 names
  the parameter at fault.
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from impasto.engine.engine_client import EngineDeadError, EngineRequestError
from impasto.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from impasto.errors import InvalidParameterError

logger = logging.getLogger("impasto")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}
_MAX_ERRORS, _MAX_INPUT_CHARS = 10, 200
RETRY_AFTER_S = 1  # what a 503 (queue full, engine shutting down) asks clients to wait


class APIError(Exception):
    """Raised by handlers; turned into an error response (with `headers`, e.g. Retry-After)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.headers = headers


def error_body(message: str, status: int, param: str | None = None) -> dict:
    err_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    info = ErrorInfo(message=message, type=err_type, param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(
    message: str, status: int, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def internal_error(exc: BaseException) -> APIError:
    """A generic 500 naming a fresh error id; the exception is logged under that id."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error (error id %s)", error_id, exc_info=exc)
    return APIError(f"Internal server error (error id {error_id}).", 500)


def unavailable(message: str) -> APIError:
    return APIError(message, 503, headers={"Retry-After": str(RETRY_AFTER_S)})


def as_api_error(exc: BaseException) -> APIError:
    """Map any exception from a handler to the status a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineRequestError):  # its message was made for clients by the engine
        if exc.status == 503:
            return unavailable(exc.message)
        return APIError(exc.message, exc.status, exc.param)
    if isinstance(exc, EngineDeadError):  # the request was in flight: it failed
        return APIError(str(exc), 500)
    if isinstance(exc, InvalidParameterError):  # every admission check raises this
        return APIError(exc.message, 400, exc.param)
    # Any other ValueError / TypeError is a bug, not the client's fault: a generic 500 below
    # (its message could carry internals).
    if isinstance(exc, NotImplementedError):
        return APIError(str(exc), 501)
    return internal_error(exc)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts, param = [], None
    for err in errors[:_MAX_ERRORS]:
        if err.get("type") == "json_invalid":
            parts.append(f"Invalid JSON body: {err.get('ctx', {}).get('error', 'parse error')}")
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        value = repr(err.get("input"))
        if len(value) > _MAX_INPUT_CHARS:
            value = value[:_MAX_INPUT_CHARS] + "..."
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')} (input: {value})")
    if len(errors) > _MAX_ERRORS:
        parts.append(f"... and {len(errors) - _MAX_ERRORS} more errors")
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.headers)

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> JSONResponse:
        err = as_api_error(exc)
        return error_response(err.message, err.status, err.param, err.headers)
