"""Server-sent events and client disconnects.

* `event_stream`: an SSE response (``data: {...}`` events, then ``data: [DONE]``). An engine or
  API error mid-stream becomes an OpenAI error event (the HTTP status is already sent);
  whatever ends the stream, a client that disconnects included (Starlette cancels it), the
  requests behind it are aborted.
* `unless_disconnected`: a non-streaming request races its client's ``http.disconnect``; a
  client that leaves first has its requests aborted.
* `merged`: the outputs of several request streams (a completions ``prompt`` list) as one.

Either way the engine frees an aborted request's blocks before its next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from pagedkv.engine.async_llm import EngineDeadError, EngineGenerateError, RequestStream
from pagedkv.engine.outputs import RequestOutput
from pagedkv.entrypoints.openai.errors import APIError, engine_error

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: BaseModel | dict[str, Any]) -> str:
    """One SSE event holding ``obj`` as JSON."""
    data = (
        obj.model_dump_json(exclude_unset=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    )
    return f"data: {data}\n\n"


def sse_error(e: Exception, param: str) -> str:
    """An in-stream OpenAI error event (the HTTP status is already sent)."""
    return sse(engine_error(e, param).body())


def event_stream(
    body: AsyncIterator[str], streams: list[RequestStream], param: str
) -> StreamingResponse:
    """An SSE response of ``body``'s events, then ``[DONE]``. An engine or API error mid-stream
    becomes an error event naming ``param``; whatever ends the stream (a client that
    disconnects too), the requests behind it are aborted."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in body:
                yield event
        except (EngineDeadError, EngineGenerateError, APIError) as e:
            yield sse_error(e, param)
        finally:
            await body.aclose()  # type: ignore[attr-defined]
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"

    return StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(prompt index, newest output)`` from several streams until all finished; the first
    error of any stream is raised."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except BaseException as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield i, item
            if item.finished:
                remaining -= 1
    finally:
        for t in tasks:
            t.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(
    request: Request, coro: Awaitable[T], streams: list[RequestStream]
) -> T | None:
    """Run ``coro``; if the client disconnects first, cancel it and return None. Either way
    ``streams`` are aborted at the end (a no-op for finished requests)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        logger.info("client disconnected: aborting %s", ", ".join(s.request_id for s in streams))
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        for s in streams:
            s.abort()
