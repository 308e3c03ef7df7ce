"""ASGI middleware of the server: access log, API key, request body size.

Plain ASGI (not ``BaseHTTPMiddleware``): they see every byte of the body as it arrives and
never buffer a streamed response. Refusals are OpenAI's error JSON (`errors.APIError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from typing import Any

from pagedkv.entrypoints.openai.errors import APIError

access_logger = logging.getLogger("pagedkv.access")

ASGIApp = Any  # (scope, receive, send) -> Awaitable[None]

# A refused body is read and dropped (never held) before the 413 goes out, up to this many
# bytes and this long: closing a socket with unread bytes makes the kernel answer RST, and a
# client that sent its whole body before reading then gets "connection reset" instead of the
# 413 (nginx's lingering close, for the same reason). Bigger or slower bodies are cut off.
DRAIN_MAX_BYTES = 64 * 2**20
DRAIN_TIMEOUT_S = 5.0

# Routes that stay open when an API key is set (as in vLLM: health, metrics; the read-only
# dashboard and API docs too). Everything else (/v1/*, /reset_prefix_cache, unknown paths)
# needs ``Authorization: Bearer KEY``.
OPEN_PATHS = frozenset(
    {
        "/",
        "/health",
        "/ping",
        "/version",
        "/metrics",
        "/dashboard",
        "/dashboard/state",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
        "/openapi.json",
    }
)


REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_CHARS = 256


class RequestIdMiddleware:
    """Every response carries ``X-Request-Id``: the request's own header when it has one (a
    client's or a gateway's trace id), else a fresh random one. The routes read it from
    ``request.state.request_id`` and use it as the request id (``cmpl-<id>``, the engine's id,
    the access log). A header that is not 1-256 printable ASCII characters is a 400 naming
    ``x-request-id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = next((v for k, v in scope["headers"] if k.lower() == REQUEST_ID_HEADER), None)
        if raw is None:
            rid = uuid.uuid4().hex
        else:
            rid = raw.decode("latin-1")
            if not 0 < len(rid) <= MAX_REQUEST_ID_CHARS or not all(32 < ord(c) < 127 for c in rid):
                err = APIError(
                    400,
                    f"x-request-id must be 1-{MAX_REQUEST_ID_CHARS} printable ASCII characters "
                    "without spaces",
                    "invalid_request_error",
                    "x-request-id",
                )
                await err.response()(scope, receive, send)
                return
        scope.setdefault("state", {})["request_id"] = rid

        async def send_(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_)


class AccessLogMiddleware:
    """One ``pagedkv.access`` line at INFO per HTTP request: client, request id, method, path,
    status and the time until the response (a stream: its end) was sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0  # stays 0 when the client left before any response

        async def send_(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            client = scope.get("client")
            access_logger.info(
                '%s %s - "%s %s" %d %.1f ms',
                f"{client[0]}:{client[1]}" if client else "-",
                (scope.get("state") or {}).get("request_id", "-"),
                scope["method"],
                scope["path"],
                status,
                (time.perf_counter() - t0) * 1e3,
            )


class APIKeyMiddleware:
    """Every path outside `OPEN_PATHS` answers 401 (OpenAI's error JSON) unless the request
    carries ``Authorization: Bearer <api_key>``; the key is compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    def authorized(self, scope: dict[str, Any]) -> bool:
        value = b""
        for name, v in scope["headers"]:
            if name.lower() == b"authorization":
                value = v
        scheme, _, token = value.strip().partition(b" ")
        # compare_digest: no early exit on the first differing byte (no timing oracle).
        return hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] not in OPEN_PATHS
            and not self.authorized(scope)
        ):
            err = APIError(
                401,
                "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                "invalid_request_error",
                None,
                "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def discard_body(receive: Any, budget: int) -> None:
    """Receive and drop the rest of a request body; stop at its end, at a disconnect, or once
    ``budget`` bytes came (nothing is received when ``budget`` <= 0)."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


class MaxBodySizeMiddleware:
    """413 (OpenAI's error JSON) for a request body over ``max_bytes``: without reading it into
    memory when its ``Content-Length`` says so; a chunked body (no length) is read up to the
    limit first and refused as soon as it passes it, so that no body bigger than the limit is
    ever held. Before answering, the rest of the body is drained (`DRAIN_MAX_BYTES`,
    `DRAIN_TIMEOUT_S`) so that the client can read the answer."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's limit of {self.max_bytes} "
            "bytes (pagedkv serve --max-request-bytes)",
            "invalid_request_error",
            None,
            "request_too_large",
            headers={"Connection": "close"},
        )

    async def refuse(self, scope: dict[str, Any], receive: Any, send: Any, remaining: int) -> None:
        """Drain the ``remaining`` bytes still to come (0: the body is all in; none are read when
        over `DRAIN_MAX_BYTES`), then 413."""
        if 0 < remaining <= DRAIN_MAX_BYTES:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(discard_body(receive, remaining), DRAIN_TIMEOUT_S)
        await self.too_large().response()(scope, receive, send)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if length is not None:
            if length.strip().isdigit() and int(length) > self.max_bytes:
                await self.refuse(scope, receive, send, int(length))
                return
            await self.app(scope, receive, send)
            return
        buffered: list[dict[str, Any]] = []
        size = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                buffered.clear()  # not held during the drain
                await self.refuse(
                    scope, receive, send, DRAIN_MAX_BYTES if message.get("more_body", False) else 0
                )
                return
            if not message.get("more_body", False):
                break

        async def replay() -> dict[str, Any]:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)
