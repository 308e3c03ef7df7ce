"""Prefill/decode forwarding (vLLM's toy proxy, with retries): `run_prefill` on a prefill
instance, `run_decode` on a decode instance, `handle_completion` for one client request, and
`check_health`. The protocol is described in `pagedkv.entrypoints.proxy`; the router forwards
each request with the same functions (`pagedkv.router.server`)."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from typing import Any

from pagedkv.forwarding.client import (
    InstanceFailed,
    forward_headers,
    invalid_body,
    passthrough,
    read_body,
    send_request,
    unavailable,
)
from pagedkv.forwarding.instances import RETRY_PAUSE_S, Instance, ProxyState
from pagedkv.forwarding.relay import relay_stream

__all__ = [
    "PREFILL_KV_TRANSFER_PARAMS",
    "check_health",
    "handle_completion",
    "has_images",
    "prefill_body",
    "run_decode",
    "run_encode",
    "run_prefill",
]

logger = logging.getLogger(__name__)

# What the prefill instance gets as kv_transfer_params (vLLM's toy proxy, pull mode).
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body the prefill instance gets: one token, not streamed, KV kept for a decoder."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


async def _first_answer(
    state: ProxyState,
    pool: Any,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    key: str,
) -> tuple[Instance | None, dict[str, Any] | None, Any]:
    """POST ``body`` to the first instance of ``pool`` that does not fail: ``(instance, the
    ``key`` of its JSON answer or None, None)``; ``(None, None, None)`` when every one failed;
    ``(instance, None, response)`` when it answered 4xx (for the client as it is)."""
    for inst in pool.candidates():
        try:
            resp = await send_request(state.client, inst.url, "POST", path, body, headers)
            content = await read_body(resp)
        except InstanceFailed as e:
            pool.mark_failed(inst, str(e))
            continue
        pool.mark_ok(inst)
        if resp.status_code >= 400:
            return inst, None, passthrough(resp.status_code, content, resp.headers)
        try:
            value = json.loads(content).get(key)
        except (ValueError, AttributeError):
            value = None  # not our JSON: the next stage computes it itself
        return inst, value, None
    return None, None, None


async def run_prefill(
    state: ProxyState, path: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[Instance | None, dict[str, Any] | None, Any]:
    """Prefill on the first prefill instance that does not fail: ``(instance, its
    kv_transfer_params, None)``; ``(None, None, None)`` when every one failed (colocated
    fallback); ``(instance, None, response)`` when it answered 4xx (for the client as it is)."""
    out = await _first_answer(
        state, state.prefill, path, prefill_body(body), headers, "kv_transfer_params"
    )
    if out[0] is None:
        logger.warning("every prefill instance failed: the decode instance computes the prompt")
    return out


async def run_decode(
    state: ProxyState,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    stream: bool,
) -> tuple[Instance | None, Any]:
    """The client's response from the first decode instance that does not fail (SSE passed
    through chunk by chunk when ``stream``, resumed elsewhere if it breaks: `relay_stream`), or
    a 503 when every one failed. After a failure the body goes on without
    ``kv_transfer_params``: the failed instance may have read the producer's blocks and released
    them (reading them again could read reused blocks), so the next instance computes the
    prompt itself."""
    from fastapi.responses import StreamingResponse

    if stream and body is not None:
        body = dict(body, return_token_ids=True)  # what `relay_stream` resumes from
    deadline = time.monotonic() + state.retry_window
    while True:
        for inst in state.decode.candidates():
            try:
                resp = await send_request(state.client, inst.url, method, path, body, headers)
                if not stream or resp.status_code != 200:
                    content = await read_body(resp)
                    state.decode.mark_ok(inst)
                    return inst, passthrough(resp.status_code, content, resp.headers)
            except InstanceFailed as e:
                state.decode.mark_failed(inst, str(e))
                if body is not None and body.get("kv_transfer_params") is not None:
                    body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
                continue
            state.decode.mark_ok(inst)
            assert body is not None
            media_type = resp.headers.get("content-type", "text/event-stream")
            return inst, StreamingResponse(
                relay_stream(state, resp, inst, body, path, headers),
                status_code=resp.status_code,
                media_type=media_type,
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        if time.monotonic() + RETRY_PAUSE_S >= deadline:
            break
        await asyncio.sleep(RETRY_PAUSE_S)  # every one failed: one may be restarting
    return None, unavailable(
        f"no {state.decode.role} instance is available "
        f"({len(state.decode.instances)} tried for {state.retry_window:g} s)"
    )


def has_images(body: dict[str, Any]) -> bool:
    """Whether a chat body carries an ``image_url`` content part."""
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content
        ):
            return True
    return False


async def run_encode(
    state: ProxyState, body: dict[str, Any], headers: dict[str, str]
) -> tuple[Any, dict[str, Any] | None, Any]:
    """EPD: the request's images encoded on the first encoder instance that does not fail:
    ``(instance, its ec_transfer_params, None)``; ``(None, None, None)`` when every one failed
    (the prefill instance encodes them itself); ``(instance, None, response)`` for a 4xx (the
    client's fault: returned as it is)."""
    assert state.encoder is not None
    ebody = {k: v for k, v in body.items() if k in ("model", "messages")}
    out = await _first_answer(
        state, state.encoder, "/v1/encode", ebody, headers, "ec_transfer_params"
    )
    if out[0] is None:
        logger.warning("every encoder instance failed: the prefill instance encodes the images")
    return out


async def handle_completion(state: ProxyState, request: Any, path: str) -> Any:
    """One ``/v1/completions`` or ``/v1/chat/completions`` request: encode (a chat request
    with images, when the proxy has encoder instances), prefill, then decode."""
    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return invalid_body()
    request_id = str(uuid.uuid4())
    headers = forward_headers(request, request_id)
    if state.encoder is not None and path == "/v1/chat/completions" and has_images(body):
        e_inst, ec_params, early = await run_encode(state, body, headers)
        if early is not None:
            return early
        state.encoded.append((request_id, e_inst.url if e_inst else None))
        if ec_params is not None:  # prefill and decode read the outputs (decode: on a retry)
            body = dict(body, ec_transfer_params=ec_params)
    p_inst, params, early = await run_prefill(state, path, body, headers)
    if early is not None:
        logger.debug(
            "request %s: prefill %s answered %s", request_id, p_inst.url, early.status_code
        )
        return early
    dbody = copy.copy(body)
    if params is not None:
        dbody["kv_transfer_params"] = params
    stream = bool(body.get("stream"))
    d_inst, response = await run_decode(state, "POST", path, dbody, headers, stream)
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
