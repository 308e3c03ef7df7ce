"""The app of ``pagedkv proxy``, the front end of prefill/decode (PD) disaggregation (vLLM's toy
proxy, with retries): `create_proxy_app`. The forwarding is `pagedkv.forwarding` (shared with the
router); the command is `pagedkv.entrypoints.cli.proxy`.

    pagedkv serve --port 8100 ...            # prefill instance(s)
    pagedkv serve --port 8200 ...            # decode instance(s)
    pagedkv proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Clients speak OpenAI's API to the proxy (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health``). Per completion request:

1. A uuid request id goes as ``X-Request-Id`` to both instances.
2. The prefill instance (round-robin) gets the body with ``kv_transfer_params:
   {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
   "remote_block_ids": null, "remote_host": null, "remote_port": null}``, ``stream: false``,
   ``max_tokens: 1`` (and ``max_completion_tokens: 1`` if present), without ``stream_options``
   and ``min_tokens``: it computes the prompt's KV and keeps it for the decode instance.
3. The ``kv_transfer_params`` of its response (where the KV lies; null without a KV connector,
   and then the decode instance simply computes the prompt itself) replace those of the
   client's body, which goes to a decode instance (round-robin); its answer is returned as it
   is, SSE chunk by chunk when streaming.

Faults: an instance that fails (connection error, timeout, 5xx) is marked unhealthy for
``--cooldown`` seconds (skipped meanwhile, unless every instance of its role is) and the request
is retried on the next instance of the role. If every prefill instance fails, the client's body
goes straight to a decode instance (colocated fallback: it computes the prompt). If every decode
instance keeps failing for ``retry_window`` seconds (rounds 0.5 s apart), the client gets a 503 with
OpenAI's error JSON. A 4xx is the client's fault: it
is returned as it is, never retried. A decode stream that breaks (the instance dies mid-answer) is
resumed: each unfinished choice continues on another instance from the tokens the client already
has (`pagedkv.forwarding.stream_resume`), so the client sees one unbroken stream. A retried
decode request goes without ``kv_transfer_params`` (the next instance computes the prompt
itself).

**EPD** (``--encoder URL ...``): a chat request with ``image_url`` parts first goes to an
encoder instance (``pagedkv serve --ec-transfer-config '{"ec_role":"ec_producer"}'``) as
``POST /v1/encode`` with its ``model`` and ``messages``; the ``ec_transfer_params`` it answers
(where the images' encoder outputs are kept) join the body the prefill and decode instances
get, so they read the outputs instead of encoding. Every encoder failing means the prefill
instance encodes the images itself; an encoder's 4xx (a bad image) is returned as it is.

``/health`` is 200 when at least one decode instance answers its own ``/health``, else 503;
``/v1/models`` is forwarded to a decode instance. At DEBUG level the proxy logs which instances
served each request.
"""

# No ``from __future__ import annotations``: the routes are defined inside create_proxy_app
# with fastapi imported there (lazily, so ``pagedkv --help`` stays fast), and FastAPI resolves
# string annotations in module globals only.

import uuid
from collections.abc import AsyncIterator
from typing import Any

from pagedkv.forwarding import (
    InstancePool,
    ProxyState,
    check_health,
    forward_headers,
    handle_completion,
    instance_client,
    run_decode,
    unavailable,
)

__all__ = ["create_proxy_app"]


def create_proxy_app(
    prefill: list[str],
    decode: list[str],
    cooldown: float = 5.0,
    timeout: float = 600.0,
    retry_window: float = 30.0,
    encoder: list[str] | None = None,
) -> Any:
    """The proxy's FastAPI app over instance base URLs (``http://host:port``); ``timeout``
    bounds each read from an instance (seconds), connecting is bounded by 10 s;
    ``retry_window``: how long a request keeps retrying when every instance fails;
    ``encoder``: encoder instances (EPD) for chat requests with images."""
    import contextlib

    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    if not prefill or not decode:
        raise ValueError("the proxy needs at least one prefill and one decode instance")
    client = instance_client(timeout)
    state = ProxyState(
        prefill=InstancePool.from_urls("prefill", prefill, cooldown),
        decode=InstancePool.from_urls("decode", decode, cooldown),
        client=client,
        retry_window=retry_window,
        encoder=InstancePool.from_urls("encoder", encoder, cooldown) if encoder else None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="pagedkv PD proxy", lifespan=lifespan)
    app.state.proxy = state

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_completion(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle_completion(state, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = forward_headers(request, str(uuid.uuid4()))
        return (await run_decode(state, "GET", "/v1/models", None, headers, stream=False))[1]

    @app.get("/health")
    async def health() -> Response:
        if await check_health(state):
            return Response(status_code=200)
        return unavailable("no decode instance is healthy")

    return app
