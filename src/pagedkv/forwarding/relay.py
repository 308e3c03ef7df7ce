"""Relaying a decode instance's SSE stream to the client, and resuming it elsewhere when it
breaks: each unfinished choice continues on another instance from the tokens the client already
has (`StreamTracker`, stream_resume.py), so the client sees one unbroken stream."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedkv.forwarding.client import InstanceFailed, send_request
from pagedkv.forwarding.instances import RETRY_PAUSE_S, Instance, ProxyState
from pagedkv.forwarding.stream_resume import ChoiceState, StreamTracker

__all__ = ["pump", "relay_stream", "resume_choice"]

logger = logging.getLogger(__name__)


async def relay_stream(
    state: ProxyState,
    resp: Any,
    inst: Instance,
    body: dict[str, Any],
    path: str,
    headers: dict[str, str],
) -> AsyncIterator[bytes]:
    """The client's SSE stream: ``resp``'s events as they come; if it breaks (transport error,
    no ``[DONE]``, an error event), each unfinished choice is continued on another instance
    (`resume_choice`) until every choice finished, or ``state.retry_window`` seconds passed
    without success (instances restarting are waited for, in rounds 0.5 s apart): then an
    error event (the engine's last, else the proxy's own ``server_error``) and ``[DONE]`` end
    it, so a client never takes a cut stream for a complete answer."""
    tracker = StreamTracker.for_request(body, chat=path.endswith("chat/completions"))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    async for ev in pump(tracker, resp, inst.url, None, False):
        yield ev
    if not tracker.done or tracker.broken:
        state.decode.mark_failed(inst, "stream broke")
        deadline = time.monotonic() + state.retry_window
        while tracker.unfinished() and time.monotonic() < deadline:
            idx = tracker.unfinished()[0]
            async for ev in resume_choice(state, tracker, idx, headers):
                yield ev
            if not tracker.choices[idx].finished:
                await asyncio.sleep(RETRY_PAUSE_S)  # every instance failed: one may be restarting
    if tracker.unfinished():
        logger.warning(
            "a broken stream could not be resumed within %.0f s (%d choices unfinished)",
            state.retry_window,
            len(tracker.unfinished()),
        )
        # Always an error event before [DONE]: a stream that just stopped would read as a
        # complete (short) answer to an OpenAI client.
        message = (
            f"the engine serving this stream failed and no instance could resume it "
            f"within {state.retry_window:g} s"
        )
        error = {"error": {"message": message, "type": "server_error", "param": None, "code": 503}}
        yield tracker.error_event or ("data: " + json.dumps(error) + "\n\n").encode()
        yield b"data: [DONE]\n\n"
        return
    for ev in tracker.finish(include_usage):
        yield ev


async def resume_choice(
    state: ProxyState, tracker: StreamTracker, idx: int, headers: dict[str, str]
) -> AsyncIterator[bytes]:
    """One round: continue choice ``idx`` on the instances in turn (decode ones first, then
    prefill ones: any engine can continue) until one streams it to its end. A continuation
    that breaks too is continued on the next from where it broke."""
    for pool in (state.decode, state.prefill):
        for nxt in pool.candidates():
            if tracker.choices.setdefault(idx, ChoiceState()).finished:
                return
            cont = tracker.continuation(idx)
            if cont is None:  # its token budget ran out exactly at the break
                yield tracker.finish_choice(idx)
                return
            try:
                r = await send_request(state.client, nxt.url, "POST", cont[0], cont[1], headers)
            except InstanceFailed as e:
                pool.mark_failed(nxt, str(e))
                continue
            if r.status_code != 200:
                await r.aclose()
                logger.warning("resuming on %s: HTTP %s", nxt.url, r.status_code)
                continue
            logger.info("resuming choice %d of a broken stream on %s", idx, nxt.url)
            async for ev in pump(tracker, r, nxt.url, {0: idx}, cont[0] == "/v1/completions"):
                yield ev
            if not tracker.choices[idx].finished:
                pool.mark_failed(nxt, "stream broke")


async def pump(
    tracker: StreamTracker,
    resp: Any,
    url: str,
    choice_map: dict[int, int] | None,
    continuation: bool,
) -> AsyncIterator[bytes]:
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
