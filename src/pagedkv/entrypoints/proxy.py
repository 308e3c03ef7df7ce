"""``pagedkv proxy``: the front end of prefill/decode (PD) disaggregation (vLLM's toy proxy,
with retries).

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
has (stream_resume.py), so the client sees one unbroken stream. A retried decode request goes
without ``kv_transfer_params`` (the next instance computes the prompt itself).

``/health`` is 200 when at least one decode instance answers its own ``/health``, else 503;
``/v1/models`` is forwarded to a decode instance. At DEBUG level the proxy logs which instances
served each request.
"""

# No ``from __future__ import annotations``: the routes are defined inside create_proxy_app
# with fastapi imported there (lazily, so ``pagedkv --help`` stays fast), and FastAPI resolves
# string annotations in module globals only.

import argparse
import asyncio
import copy
import json
import logging
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.5  # between rounds over every instance of a role (one may be restarting)

# What the prefill instance gets as kv_transfer_params (vLLM's toy proxy, pull mode).
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}

DESCRIPTION = """\
Prefill/decode disaggregation front end (vLLM's design): OpenAI's API in and out. Each
completion or chat request is prefilled on a --prefill instance (max_tokens 1, kv_transfer_params
{"do_remote_decode": true, ...}); the kv_transfer_params it returns go with the original request
to a --decode instance, whose answer (streamed or not) goes back to the client unchanged.

Instances of a role are used round-robin. A failing instance (connection error, timeout, 5xx) is
skipped for --cooldown seconds and the request retried on the next one; if every prefill
instance fails the decode instance computes the prompt itself; if every decode instance keeps
failing for --retry-window seconds (rounds 0.5 s apart) the client gets 503. A stream cut
mid-answer is continued on another instance from the tokens already sent. 4xx answers are returned as they are. /health is 200 while a decode
instance is healthy; /v1/models comes from a decode instance. Prints "pagedkv proxy: listening
on http://HOST:PORT" once it accepts connections (--port 0 picks a free port).
"""

EXAMPLES = """\
examples:
  pagedkv proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
  pagedkv proxy --prefill http://p1:8000 http://p2:8000 --decode http://d1:8000 http://d2:8000
"""


# ---- instances ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Instance:
    """One ``pagedkv serve`` (or vLLM) server; unhealthy until ``unhealthy_until`` (monotonic)."""

    url: str
    unhealthy_until: float = 0.0

    def healthy(self, now: float) -> bool:
        return now >= self.unhealthy_until


@dataclass(slots=True)
class InstancePool:
    """The instances of one role, used round-robin; failing ones sit out ``cooldown`` seconds."""

    role: str
    instances: list[Instance]
    cooldown: float = 5.0
    _next: int = 0

    @classmethod
    def from_urls(cls, role: str, urls: list[str], cooldown: float = 5.0) -> "InstancePool":
        return cls(role, [Instance(u.rstrip("/")) for u in urls], cooldown)

    def candidates(self) -> list[Instance]:
        """Every instance, in the order to try them for one request: round-robin from the next
        one, healthy first (unhealthy ones last: better a retry than a 503 when all are)."""
        n = len(self.instances)
        start, self._next = self._next, (self._next + 1) % n
        order = [self.instances[(start + i) % n] for i in range(n)]
        now = time.monotonic()
        return [x for x in order if x.healthy(now)] + [x for x in order if not x.healthy(now)]

    def mark_failed(self, inst: Instance, why: str) -> None:
        inst.unhealthy_until = time.monotonic() + self.cooldown
        logger.warning("%s instance %s failed (%s): skipped for %.1f s", self.role, inst.url, why,
                       self.cooldown)

    def mark_ok(self, inst: Instance) -> None:
        inst.unhealthy_until = 0.0

    def any_healthy(self) -> bool:
        now = time.monotonic()
        return any(x.healthy(now) for x in self.instances)


@dataclass(slots=True)
class ProxyState:
    """What the routes share (``app.state.proxy``); ``client`` is an ``httpx.AsyncClient``."""

    prefill: InstancePool
    decode: InstancePool
    client: Any
    health_timeout: float = 2.0
    # How long a request waits for an instance (rounds RETRY_PAUSE_S apart) before giving up.
    retry_window: float = 30.0
    # The last requests' (request id, prefill URL or None, decode URL or None), newest last.
    served: deque[tuple[str, str | None, str | None]] = field(default_factory=lambda: deque(maxlen=1000))


# ---- forwarding ---------------------------------------------------------------------------------


class InstanceFailed(Exception):
    """An instance failed in a way worth retrying elsewhere (no connection, timeout, 5xx)."""


async def _send(state: ProxyState, inst: Instance, method: str, path: str, body: dict[str, Any] | None,
                headers: dict[str, str]) -> Any:
    """The response of ``inst`` to one request, its body not read yet (``stream=True``); a 5xx
    or a transport error raises `InstanceFailed` (the response closed)."""
    import httpx

    req = state.client.build_request(method, inst.url + path, json=body, headers=headers)
    try:
        resp = await state.client.send(req, stream=True)
    except httpx.HTTPError as e:
        raise InstanceFailed(f"{type(e).__name__}: {e}") from None
    if resp.status_code >= 500:
        await resp.aclose()
        raise InstanceFailed(f"HTTP {resp.status_code}")
    return resp


async def _read(resp: Any) -> bytes:
    """The whole body of ``resp`` (closed after); a transport error is `InstanceFailed`."""
    import httpx

    try:
        return await resp.aread()
    except httpx.HTTPError as e:
        raise InstanceFailed(f"{type(e).__name__}: {e}") from None
    finally:
        await resp.aclose()


def _passthrough(status: int, content: bytes, headers: Any) -> Any:
    """A response with an instance's status, body and content type."""
    from fastapi.responses import Response

    return Response(content=content, status_code=status,
                    media_type=headers.get("content-type", "application/json"))


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body the prefill instance gets: one token, not streamed, KV kept for a decoder."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


async def run_prefill(state: ProxyState, path: str, body: dict[str, Any],
                      headers: dict[str, str]) -> tuple[Instance | None, dict[str, Any] | None, Any]:
    """Prefill on the first prefill instance that does not fail: ``(instance, its
    kv_transfer_params, None)``; ``(None, None, None)`` when every one failed (colocated
    fallback); ``(instance, None, response)`` when it answered 4xx (for the client as it is)."""
    pbody = prefill_body(body)
    for inst in state.prefill.candidates():
        try:
            resp = await _send(state, inst, "POST", path, pbody, headers)
            content = await _read(resp)
        except InstanceFailed as e:
            state.prefill.mark_failed(inst, str(e))
            continue
        state.prefill.mark_ok(inst)
        if resp.status_code >= 400:
            return inst, None, _passthrough(resp.status_code, content, resp.headers)
        try:
            params = json.loads(content).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None  # not our JSON: the decode instance computes the prompt itself
        return inst, params, None
    logger.warning("every prefill instance failed: the decode instance computes the prompt")
    return None, None, None


async def run_decode(state: ProxyState, method: str, path: str, body: dict[str, Any] | None,
                     headers: dict[str, str], stream: bool) -> tuple[Instance | None, Any]:
    """The client's response from the first decode instance that does not fail (SSE passed
    through chunk by chunk when ``stream``, resumed elsewhere if it breaks: `_relay`), or a 503
    when every one failed. After a failure the body goes on without ``kv_transfer_params``: the
    failed instance may have read the producer's blocks and released them (reading them again
    could read reused blocks), so the next instance computes the prompt itself."""
    from fastapi.responses import StreamingResponse

    if stream and body is not None:
        body = dict(body, return_token_ids=True)  # what `_relay` resumes from
    deadline = time.monotonic() + state.retry_window
    while True:
        for inst in state.decode.candidates():
            try:
                resp = await _send(state, inst, method, path, body, headers)
                if not stream or resp.status_code != 200:
                    content = await _read(resp)
                    state.decode.mark_ok(inst)
                    return inst, _passthrough(resp.status_code, content, resp.headers)
            except InstanceFailed as e:
                state.decode.mark_failed(inst, str(e))
                if body is not None and body.get("kv_transfer_params") is not None:
                    body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
                continue
            state.decode.mark_ok(inst)
            assert body is not None
            return inst, StreamingResponse(_relay(state, resp, inst, body, path, headers),
                                           status_code=resp.status_code,
                                           media_type=resp.headers.get("content-type", "text/event-stream"),
                                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if time.monotonic() + RETRY_PAUSE_S >= deadline:
            break
        await asyncio.sleep(RETRY_PAUSE_S)  # every one failed: one may be restarting
    return None, _unavailable(f"no {state.decode.role} instance is available "
                              f"({len(state.decode.instances)} tried for {state.retry_window:g} s)")


async def _relay(state: ProxyState, resp: Any, inst: Instance, body: dict[str, Any], path: str,
                 headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The client's SSE stream: ``resp``'s events as they come; if it breaks (transport error,
    no ``[DONE]``, an error event), each unfinished choice is continued on another instance
    (`_resume_choice`) until every choice finished, or ``state.retry_window`` seconds passed
    without success (instances restarting are waited for, in rounds 0.5 s apart): then an
    error event (the engine's last, else the proxy's own ``server_error``) and ``[DONE]`` end
    it, so a client never takes a cut stream for a complete answer."""
    from pagedkv.forwarding.stream_resume import StreamTracker

    tracker = StreamTracker.for_request(body, chat=path.endswith("chat/completions"))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    async for ev in _pump(tracker, resp, inst.url, None, False):
        yield ev
    if not tracker.done or tracker.broken:
        state.decode.mark_failed(inst, "stream broke")
        deadline = time.monotonic() + state.retry_window
        while tracker.unfinished() and time.monotonic() < deadline:
            idx = tracker.unfinished()[0]
            async for ev in _resume_choice(state, tracker, idx, headers):
                yield ev
            if not tracker.choices[idx].finished:
                await asyncio.sleep(RETRY_PAUSE_S)  # every instance failed: one may be restarting
    if tracker.unfinished():
        logger.warning("a broken stream could not be resumed within %.0f s (%d choices unfinished)",
                       state.retry_window, len(tracker.unfinished()))
        # Always an error event before [DONE]: a stream that just stopped would read as a
        # complete (short) answer to an OpenAI client.
        yield tracker.error_event or (
            "data: " + json.dumps({"error": {
                "message": f"the engine serving this stream failed and no instance could resume it "
                           f"within {state.retry_window:g} s", "type": "server_error", "param": None,
                "code": 503}}) + "\n\n").encode()
        yield b"data: [DONE]\n\n"
        return
    for ev in tracker.finish(include_usage):
        yield ev


async def _resume_choice(state: ProxyState, tracker: Any, idx: int,
                         headers: dict[str, str]) -> AsyncIterator[bytes]:
    """One round: continue choice ``idx`` on the instances in turn (decode ones first, then
    prefill ones: any engine can continue) until one streams it to its end. A continuation
    that breaks too is continued on the next from where it broke."""
    from pagedkv.forwarding.stream_resume import ChoiceState

    for pool in (state.decode, state.prefill):
        for nxt in pool.candidates():
            if tracker.choices.setdefault(idx, ChoiceState()).finished:
                return
            cont = tracker.continuation(idx)
            if cont is None:  # its token budget ran out exactly at the break
                yield tracker.finish_choice(idx)
                return
            try:
                r = await _send(state, nxt, "POST", cont[0], cont[1], headers)
            except InstanceFailed as e:
                pool.mark_failed(nxt, str(e))
                continue
            if r.status_code != 200:
                await r.aclose()
                logger.warning("resuming on %s: HTTP %s", nxt.url, r.status_code)
                continue
            logger.info("resuming choice %d of a broken stream on %s", idx, nxt.url)
            async for ev in _pump(tracker, r, nxt.url, {0: idx}, cont[0] == "/v1/completions"):
                yield ev
            if not tracker.choices[idx].finished:
                pool.mark_failed(nxt, "stream broke")


async def _pump(tracker: Any, resp: Any, url: str, choice_map: dict[int, int] | None,
                continuation: bool) -> AsyncIterator[bytes]:
    """``resp``'s events through ``tracker`` until it ends, breaks or sends an error event."""
    import httpx

    tracker.start_attempt()
    try:
        async for chunk in resp.aiter_raw():
            for ev in tracker.feed(chunk, choice_map, continuation):
                yield ev
            if tracker.broken or tracker.done:
                break
    except httpx.HTTPError as e:
        logger.warning("instance %s broke mid-stream: %s", url, e)
    finally:
        await resp.aclose()


def _unavailable(message: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": "no_instance_available"}},
                        status_code=503, headers={"Retry-After": "1"})


def _forward_headers(request: Any, request_id: str) -> dict[str, str]:
    """Headers for the instances: the request id, and the client's credentials if any."""
    headers = {"X-Request-Id": request_id}
    auth = request.headers.get("authorization")
    if auth is not None:
        headers["Authorization"] = auth
    return headers


async def handle_completion(state: ProxyState, request: Any, path: str) -> Any:
    """One ``/v1/completions`` or ``/v1/chat/completions`` request: prefill, then decode."""
    from fastapi.responses import JSONResponse

    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return JSONResponse({"error": {"message": "the request body must be a JSON object",
                                       "type": "invalid_request_error", "param": None, "code": None}},
                            status_code=400)
    request_id = str(uuid.uuid4())
    headers = _forward_headers(request, request_id)
    p_inst, params, early = await run_prefill(state, path, body, headers)
    if early is not None:
        logger.debug("request %s: prefill %s answered %s", request_id, p_inst.url, early.status_code)
        return early
    dbody = copy.copy(body)
    if params is not None:
        dbody["kv_transfer_params"] = params
    d_inst, response = await run_decode(state, "POST", path, dbody, headers, bool(body.get("stream")))
    served = (request_id, p_inst.url if p_inst else None, d_inst.url if d_inst else None)
    state.served.append(served)
    logger.debug("request %s: prefill %s, decode %s", *served)
    return response


async def check_health(state: ProxyState) -> bool:
    """Whether at least one decode instance answers ``/health`` with 200 (each probed now;
    failing ones marked unhealthy, answering ones healthy)."""

    async def probe(inst: Instance) -> bool:
        try:
            r = await state.client.get(inst.url + "/health", timeout=state.health_timeout)
            ok = r.status_code == 200
        except Exception as e:  # any transport error means unhealthy
            state.decode.mark_failed(inst, f"health: {type(e).__name__}")
            return False
        if ok:
            state.decode.mark_ok(inst)
        else:
            state.decode.mark_failed(inst, f"health: HTTP {r.status_code}")
        return ok

    return any(await asyncio.gather(*(probe(i) for i in state.decode.instances)))


# ---- the app ------------------------------------------------------------------------------------


def instance_client(timeout: float) -> Any:
    """The ``httpx.AsyncClient`` the proxy (and the router) forward with: ``timeout`` bounds
    each read from an instance, connecting is bounded by 10 s, connections unbounded."""
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))


def create_proxy_app(prefill: list[str], decode: list[str], cooldown: float = 5.0,
                     timeout: float = 600.0, retry_window: float = 30.0) -> Any:
    """The proxy's FastAPI app over instance base URLs (``http://host:port``); ``timeout``
    bounds each read from an instance (seconds), connecting is bounded by 10 s;
    ``retry_window``: how long a request keeps retrying when every instance fails."""
    import contextlib

    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    if not prefill or not decode:
        raise ValueError("the proxy needs at least one prefill and one decode instance")
    client = instance_client(timeout)
    state = ProxyState(prefill=InstancePool.from_urls("prefill", prefill, cooldown),
                       decode=InstancePool.from_urls("decode", decode, cooldown),
                       client=client, retry_window=retry_window)

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
        headers = _forward_headers(request, str(uuid.uuid4()))
        return (await run_decode(state, "GET", "/v1/models", None, headers, stream=False))[1]

    @app.get("/health")
    async def health() -> Response:
        if await check_health(state):
            return Response(status_code=200)
        return _unavailable("no decode instance is healthy")

    return app


# ---- the command --------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("proxy", help="prefill/decode disaggregation front end",
                              description=DESCRIPTION, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances (http://host:port), used round-robin")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances (http://host:port), used round-robin")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--cooldown", metavar="SECONDS", type=float, default=5.0,
                   help="how long a failed instance is skipped (default 5)")
    p.add_argument("--retry-window", metavar="SECONDS", type=float, default=30.0,
                   help="how long a request keeps retrying (rounds 0.5 s apart) while every instance "
                        "it could go to fails, e.g. restarting (default 30)")
    p.add_argument("--timeout", metavar="SECONDS", type=float, default=600.0,
                   help="longest wait for an instance's next bytes (default 600)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="log level; debug logs which instances served each request (default warning)")
    p.set_defaults(func=run)
    return p


def _check_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"invalid instance URL {url!r}: use http://host:port")
    return url


def run(args: argparse.Namespace) -> int:
    from pagedkv.entrypoints.cli.serve import bind_socket, fail, serve_on_socket

    if not 0 <= args.port <= 65535:
        return fail("proxy", ValueError(f"invalid --port {args.port}"))
    if not args.cooldown >= 0 or not args.timeout > 0 or not args.retry_window >= 0:
        return fail("proxy", ValueError("--cooldown and --retry-window must be >= 0 and --timeout > 0"))
    try:
        prefill = [_check_url(u) for u in args.prefill]
        decode = [_check_url(u) for u in args.decode]
    except ValueError as e:
        return fail("proxy", e)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        return fail("proxy", OSError(f"cannot bind {args.host}:{args.port}: {e.strerror or e}"))
    app = create_proxy_app(prefill, decode, args.cooldown, args.timeout, args.retry_window)
    print(f"pagedkv proxy: prefill {' '.join(prefill)}; decode {' '.join(decode)}", flush=True)
    return serve_on_socket(app, sock, "proxy", args.log_level)


if __name__ == "__main__":  # python -m pagedkv.entrypoints.proxy ...
    parser = argparse.ArgumentParser(prog="pagedkv")
    parser_sub = parser.add_subparsers(dest="command")
    add_parser(parser_sub)
    sys.exit(run(parser.parse_args(["proxy", *sys.argv[1:]])))
