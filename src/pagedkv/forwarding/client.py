"""One request to one instance, and the responses a forwarding front end makes itself.

`send_request` and `read_body` turn every failure worth retrying elsewhere (no connection, a
timeout, a 5xx) into `InstanceFailed`; a 4xx is the client's fault and comes back as a response.
fastapi and httpx are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "InstanceFailed",
    "forward_headers",
    "instance_client",
    "invalid_body",
    "passthrough",
    "read_body",
    "send_request",
    "unavailable",
]


class InstanceFailed(Exception):
    """An instance failed in a way worth retrying elsewhere (no connection, timeout, 5xx)."""


def instance_client(timeout: float) -> Any:
    """The ``httpx.AsyncClient`` the proxy (and the router) forward with: ``timeout`` bounds
    each read from an instance, connecting is bounded by 10 s, connections unbounded."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits)


async def send_request(
    client: Any,
    url: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
) -> Any:
    """The response of the instance at ``url`` to one request, its body not read yet
    (``stream=True``); a 5xx or a transport error raises `InstanceFailed` (the response closed)."""
    import httpx

    req = client.build_request(method, url + path, json=body, headers=headers)
    try:
        resp = await client.send(req, stream=True)
    except httpx.HTTPError as e:
        raise InstanceFailed(f"{type(e).__name__}: {e}") from None
    if resp.status_code >= 500:
        await resp.aclose()
        raise InstanceFailed(f"HTTP {resp.status_code}")
    return resp


async def read_body(resp: Any) -> bytes:
    """The whole body of ``resp`` (closed after); a transport error is `InstanceFailed`."""
    import httpx

    try:
        return await resp.aread()
    except httpx.HTTPError as e:
        raise InstanceFailed(f"{type(e).__name__}: {e}") from None
    finally:
        await resp.aclose()


def passthrough(status: int, content: bytes, headers: Any) -> Any:
    """A response with an instance's status, body and content type."""
    from fastapi.responses import Response

    return Response(
        content=content,
        status_code=status,
        media_type=headers.get("content-type", "application/json"),
    )


def unavailable(message: str) -> Any:
    """503 with OpenAI's error JSON and ``Retry-After: 1``: no instance could take the request."""
    from fastapi.responses import JSONResponse

    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": "server_error",
                "param": None,
                "code": "no_instance_available",
            }
        },
        status_code=503,
        headers={"Retry-After": "1"},
    )


def invalid_body() -> Any:
    """400 with OpenAI's error JSON: the request body is not a JSON object."""
    from fastapi.responses import JSONResponse

    return JSONResponse(
        {
            "error": {
                "message": "the request body must be a JSON object",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        },
        status_code=400,
    )


def forward_headers(request: Any, request_id: str) -> dict[str, str]:
    """Headers for the instances: the request id, and the client's credentials if any."""
    headers = {"X-Request-Id": request_id}
    auth = request.headers.get("authorization")
    if auth is not None:
        headers["Authorization"] = auth
    return headers
