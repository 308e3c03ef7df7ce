"""OpenAI's error JSON and the mapping from exceptions to it.

Every error the server answers has OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}`` (`protocol.ErrorResponse`). `APIError` carries one (with its HTTP status and
headers); `engine_error` maps what `AsyncLLM` raises; `install_exception_handlers` makes the
app answer every other exception (Starlette's 404/405, anything unexpected) in the same shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.engine.async_llm import (
    DuplicateRequestIdError,
    EngineDeadError,
    EngineGenerateError,
    QueueFullError,
)
from pagedkv.engine.multimodal import ImageError
from pagedkv.engine.sampling_params import SamplingParamError
from pagedkv.entrypoints.openai import protocol as P

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying a 503 (queue full, engine down).
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An HTTP error answered as OpenAI's error JSON: ``status``, ``message``, ``type``,
    ``param`` (the request field at fault, or None), ``code`` and extra response headers."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: int | str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers

    def body(self) -> P.ErrorResponse:
        """The error JSON (also sent as an SSE event once a stream has started)."""
        return P.ErrorResponse(
            error=P.ErrorInfo(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        )

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str, code: str, type_: str = "server_error") -> APIError:
    """A 503 with ``Retry-After``: the engine is down, or its queue is full."""
    return APIError(
        503, message, type_, None, code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
    )


def internal_error(e: BaseException) -> APIError:
    """A 500 for an exception nobody expected."""
    return APIError(500, f"internal error: {e!r}", "internal_server_error", None, "internal_error")


def engine_error(e: BaseException, prompt_param: str | None) -> APIError:
    """Map an exception raised by `AsyncLLM` (``add_request``, a stream, ``run_in_engine``) to
    an APIError; ``prompt_param`` is the request field holding the prompt ("prompt",
    "messages"), named by a 400 about the prompt."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return unavailable(str(e), "queue_full", "server_overloaded")
    if isinstance(e, EngineDeadError):
        return unavailable(str(e), "engine_unavailable")
    if isinstance(e, EngineGenerateError):  # this request's step failed; the engine lives on
        return APIError(500, str(e), "internal_server_error", None, "engine_generate_error")
    if isinstance(e, DuplicateRequestIdError):  # a client's x-request-id still in flight
        return APIError(409, str(e), "conflict_error", "x-request-id", "duplicate_request_id")
    if isinstance(e, P.RequestError):
        return bad_request(e.message, e.param)
    if isinstance(e, SamplingParamError):  # the engine's check of a sampling parameter
        return bad_request(str(e), e.param)
    if isinstance(e, ImageError):  # an image in the prompt cannot be used
        return bad_request(str(e), prompt_param)
    if isinstance(e, ValueError):
        msg = str(e)
        if "longer than" in msg:
            return bad_request(msg, prompt_param, "context_length_exceeded")
        return bad_request(msg, prompt_param if "prompt" in msg else None)
    return internal_error(e)


def install_exception_handlers(app: FastAPI) -> None:
    """Answer `APIError`, Starlette's HTTP errors (404 unknown route, 405...) and any other
    exception (500, logged with its traceback) as OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(
            exc.status_code,
            str(exc.detail),
            type_,
            None,
            exc.status_code,
            headers=getattr(exc, "headers", None),
        ).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return internal_error(exc).response()
