"""The OpenAI-compatible HTTP server (FastAPI): `build_app` / `create_app`.

Routes:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``: streaming (SSE, ``data: {...}``
  chunks then ``data: [DONE]``) or not; ``n``, ``stop``, ``seed``, ``max_tokens``,
  ``temperature``, ``top_p``, ``logprobs``, ``stream_options.include_usage`` and vLLM's
  sampling extensions (see protocol.py). ``usage.prompt_tokens_details.cached_tokens`` counts
  the prompt tokens served from the prefix cache. A completions ``prompt`` may be a list of
  prompts (choice ``index = prompt_index * n + sample_index``).
* ``GET /v1/models``, ``GET /health`` (503 once the engine failed), ``GET /metrics``
  (Prometheus, see metrics.py), ``POST /reset_prefix_cache`` (409 while requests hold blocks),
  ``GET /dashboard`` and ``GET /dashboard/state`` (see dashboard.py).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON (``NaN``/``Infinity`` literals included), wrong types, invalid or non-finite
values and fields pagedkv does not implement (``param`` names the field), and for prompts or
requested completion lengths that do not fit the context (``code: context_length_exceeded``,
vLLM's wording); 401 without the API key (``api_key``); 404 for an unknown model or route; 413
for a body over ``max_request_bytes``; 503 with ``Retry-After`` when the waiting queue is full
or the engine is down; 500 when the engine step running a request failed (other requests go
on) and for anything unexpected.

Prompt text is tokenized (and chat templates rendered) on a worker thread, never on the event
loop. ``cache_salt`` is passed to the engine: requests share cached blocks only with the same
salt. Every request gets one ``pagedkv.access`` log line at INFO.

A client that disconnects has its request aborted: a stream is cancelled by Starlette when the
connection drops; a non-streaming request races its disconnect (``http.disconnect``) and is
cancelled too. Either way the engine frees the request's blocks before its next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineGenerateError,
    QueueFullError,
    RequestStream,
)
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.entrypoints import protocol as P
from pagedkv.entrypoints.metrics import ServerMetrics

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("pagedkv.access")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
RETRY_AFTER_SECONDS = 1
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
# Routes that stay open when an API key is set (as in vLLM: health, metrics; the read-only
# dashboard and API docs too). Everything else (/v1/*, /reset_prefix_cache, unknown paths)
# needs ``Authorization: Bearer KEY``.
OPEN_PATHS = frozenset({"/", "/health", "/metrics", "/dashboard", "/dashboard/state",
                        "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})

M = TypeVar("M", bound=BaseModel)


# ---- errors ------------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: int | str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.type,
                                                 param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _engine_error(e: BaseException, prompt_param: str) -> APIError:
    """Map an exception from `AsyncLLM.add_request` to an APIError."""
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), "server_overloaded", None, "queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", None, "engine_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, EngineGenerateError):  # this request's step failed; the engine lives on
        return APIError(500, str(e), "internal_server_error", None, "engine_generate_error")
    if isinstance(e, P.RequestError):
        return bad_request(e.message, e.param)
    if isinstance(e, ValueError):
        msg = str(e)
        if "longer than" in msg:
            return bad_request(msg, prompt_param, "context_length_exceeded")
        return bad_request(msg, prompt_param if "prompt" in msg else None)
    return APIError(500, f"internal error: {e!r}", "internal_server_error", None, "internal_error")


def _validation_message(err: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """One clear sentence (and the ``param``) from a pydantic error."""
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    loc = first["loc"]
    if not loc:
        return "the request body must be a JSON object", None
    # Drop union-member tags (e.g. 'str', 'list[int]') from the location.
    path = [str(loc[0])]
    for part in loc[1:]:
        if isinstance(part, int):
            path[-1] += f"[{part}]"
        elif not any(c in str(part) for c in "[]|") and part not in ("str", "int", "float", "bool"):
            path.append(str(part))
    param = ".".join(path)
    if first["type"] == "missing":
        return f"missing required field '{param}'", param
    top = str(loc[0])
    same_field = [e for e in errors if e["loc"][:1] == (top,)]
    field = model.model_fields.get(top)
    if len(same_field) > 1 and field is not None and _is_union(field.annotation) and len(loc) > 1 \
            and isinstance(loc[1], str):
        # A union: every member failed. Say what was expected instead of listing each member.
        return (f"invalid type for '{top}': expected {_type_name(field.annotation)}, "
                f"got {_json_type(same_field[0].get('input'))}"), top
    return f"invalid value for '{param}': {first['msg']} (got {_short(first.get('input'))})", param


def _is_union(annotation: Any) -> bool:
    import types
    import typing

    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _type_name(annotation: Any) -> str:
    s = str(annotation).replace("typing.", "")
    return s.replace("pagedkv.entrypoints.protocol.", "")


def _json_type(x: Any) -> str:
    for t, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                    (list, "array"), (dict, "object"), (type(None), "null")):
        if isinstance(x, t):
            return name
    return type(x).__name__


def _short(x: Any) -> str:
    try:
        s = json.dumps(x)
    except (TypeError, ValueError):
        s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


class _NonFinite:
    """Stands for a ``NaN``/``Infinity``/``-Infinity`` literal while locating it."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _non_finite_path(obj: Any, path: str = "") -> tuple[str, str] | None:
    """``(field path, literal)`` of the first `_NonFinite` in a parsed body, else None."""
    if isinstance(obj, _NonFinite):
        return path, obj.literal
    items: Any = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        sub = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = _non_finite_path(value, sub)
        if found is not None:
            return found
    return None


def check_non_finite_literals(body: bytes) -> None:
    """Refuse ``NaN``, ``Infinity`` and ``-Infinity``: Python's and pydantic's JSON parsers
    accept them, but they are not JSON and a NaN sampling parameter would poison the sampler.
    The 400 names the field holding the literal. Bodies that merely mention the words inside
    strings pass (the byte scan is a cheap filter; the parse decides)."""
    if b"NaN" not in body and b"Infinity" not in body:
        return
    try:
        parsed = json.loads(body, parse_constant=_NonFinite)
    except ValueError:
        return  # malformed: pydantic reports it
    found = _non_finite_path(parsed)
    if found is None:
        return
    path, literal = found
    if not path:
        raise bad_request("invalid JSON: NaN/Infinity are not valid numbers")
    raise bad_request(f"invalid value for '{path}': {literal} is not a valid number "
                      "(invalid JSON: NaN/Infinity are not valid numbers)", path)


async def parse_body(request: Request, model: type[M]) -> M:
    body = await request.body()
    check_non_finite_literals(body)
    try:
        parsed = model.model_validate_json(body or b"null")
    except ValidationError as e:
        msg, param = _validation_message(e, model)
        raise bad_request(msg, param) from None
    check = getattr(parsed, "check", None)
    if check is not None:
        try:
            check()
        except P.RequestError as e:
            raise bad_request(e.message, e.param) from None
    return parsed


# ---- server state --------------------------------------------------------------------------------


@dataclass
class ServerState:
    async_llm: AsyncLLM
    served_model_name: str
    model_aliases: set[str]
    metrics: ServerMetrics
    kv_event_publisher: Any = None
    started: float = field(default_factory=time.time)
    token_text_cache: dict[int, str] = field(default_factory=dict)

    def token_text(self, token_id: int) -> str:
        s = self.token_text_cache.get(token_id)
        if s is None:
            tok = self.async_llm.tokenizer
            s = tok.decode([token_id], skip_special_tokens=False) if tok is not None else str(token_id)
            if len(self.token_text_cache) < 200_000:
                self.token_text_cache[token_id] = s
        return s

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_aliases:
            raise APIError(404, f"The model '{name}' does not exist; this server serves "
                           f"'{self.served_model_name}'.", "invalid_request_error", "model",
                           "model_not_found")


def _state(request: Request) -> ServerState:
    return request.app.state.pagedkv


# ---- request plumbing ----------------------------------------------------------------------------


async def _add_all(state: ServerState, base_id: str, prompts: list[Any], params: SamplingParams,
                   prompt_param: str, cache_salt: str | None = None) -> list[RequestStream]:
    """Queue every prompt (all or none: a failure aborts those already queued)."""
    streams: list[RequestStream] = []
    arrival = time.monotonic()
    try:
        for i, prompt in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(await state.async_llm.add_request(rid, prompt, params, arrival,
                                                             cache_salt=cache_salt))
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, asyncio.CancelledError):
            raise
        raise _engine_error(e, prompt_param) from None
    return streams


async def _tokenize(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of every prompt; text is tokenized on a worker thread, so that a huge prompt
    stalls neither the event loop (other streams) nor the engine thread."""
    texts = [p for p in prompts if isinstance(p, str)]
    if not texts:
        return [list(p) for p in prompts]  # type: ignore[arg-type]
    tok = state.async_llm.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
    encoded = iter(await asyncio.to_thread(lambda: [tok.encode(t) for t in texts]))
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]


def check_context_length(max_model_len: int, prompt_lens: list[int],
                         requested: tuple[str, int] | None, where: str) -> None:
    """vLLM's context-length check: a prompt longer than ``max_model_len``, or a requested
    completion length (``requested = (field, tokens)``) that does not fit after the prompt, is
    a 400 (``code: context_length_exceeded``) in vLLM's words; ``where`` is "prompt" or
    "messages". A length the client did not ask for is clamped by the engine instead."""
    for n in prompt_lens:
        head = f"This model's maximum context length is {max_model_len} tokens. However, you requested"
        if n > max_model_len:
            raise bad_request(f"{head} {n} tokens in the {where}. Please reduce the length of the {where}.",
                              where, "context_length_exceeded")
        if requested is not None and n + requested[1] > max_model_len:
            field_, c = requested
            raise bad_request(f"{head} {n + c} tokens ({n} in the {where}, {c} in the completion). "
                              f"Please reduce the length of the {where} or completion.",
                              field_, "context_length_exceeded")


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(prompt index, newest output)`` from several streams until all finished."""
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


T = TypeVar("T")


async def _unless_disconnected(request: Request, coro: Awaitable[T], streams: list[RequestStream]) -> T | None:
    """Run ``coro``; if the client disconnects first, cancel it, abort ``streams`` and return None."""
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


def _sse_error(e: Exception, param: str) -> str:
    """An in-stream OpenAI error event (the HTTP status is already sent)."""
    err = e if isinstance(e, APIError) else _engine_error(e, param)
    return _sse(P.ErrorResponse(error=P.ErrorInfo(message=err.message, type=err.type,
                                                 param=err.param, code=err.code)))


def _usage_flags(opts: P.StreamOptions | None) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage_stats)`` of a request's ``stream_options``."""
    return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)


def _event_stream(body: AsyncIterator[str], streams: list[RequestStream], param: str) -> StreamingResponse:
    """An SSE response of ``body``'s events, then ``[DONE]``. An engine or API error mid-stream
    becomes an error event naming ``param``; whatever ends the stream (a client that
    disconnects too), the requests behind it are aborted."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in body:
                yield event
        except (EngineDeadError, EngineGenerateError, APIError) as e:
            yield _sse_error(e, param)
        finally:
            await body.aclose()  # type: ignore[attr-defined]
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj.model_dump_json(exclude_unset=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


def _usage(outs: list[RequestOutput | None]) -> P.UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outs if o is not None)
    completion = sum(len(c.token_ids) for o in outs if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs if o is not None)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


@dataclass
class _ChoiceCursor:
    """What one choice has streamed so far."""

    text_len: int = 0
    num_tokens: int = 0
    started: bool = False
    done: bool = False


def _holdback(params: SamplingParams) -> int:
    """Characters to hold back while streaming: a stop string may be forming at the end of the
    text, and the engine cuts it when it completes (vLLM's stop buffer)."""
    if not params.stop_strings or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop_strings) - 1


def _delta(cur: _ChoiceCursor, c: CompletionOutput, holdback: int) -> tuple[str, int, int]:
    """``(new text, first new token, end token)`` of choice ``c`` since ``cur``; advances it."""
    text = c.text
    end = len(text) if c.finish_reason is not None else max(len(text) - holdback, cur.text_len)
    new_text = text[cur.text_len:end]
    tok0, tok1 = cur.num_tokens, len(c.token_ids)
    cur.text_len = end
    cur.num_tokens = tok1
    return new_text, tok0, tok1


# ---- logprobs ------------------------------------------------------------------------------------


def _completion_logprobs(state: ServerState, c: CompletionOutput, k: int, t0: int, t1: int,
                         offset0: int) -> P.CompletionLogProbs:
    lp = P.CompletionLogProbs()
    offset = offset0
    for i in range(t0, t1):
        tid = c.token_ids[i]
        d = c.logprobs[i] if c.logprobs is not None and i < len(c.logprobs) else {}
        text = state.token_text(tid)
        chosen = d.get(tid)
        lp.tokens.append(text)
        lp.token_logprobs.append(chosen.logprob if chosen is not None else None)
        top = sorted((x for x in d.items() if x[1].rank <= max(k, 1)), key=lambda x: x[1].rank)[:k]
        lp.top_logprobs.append({state.token_text(t): v.logprob for t, v in top} if k > 0 else None)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


def _chat_logprobs(state: ServerState, c: CompletionOutput, k: int, t0: int, t1: int) -> P.ChatCompletionLogProbs:
    content = []
    for i in range(t0, t1):
        tid = c.token_ids[i]
        d = c.logprobs[i] if c.logprobs is not None and i < len(c.logprobs) else {}
        text = state.token_text(tid)
        chosen = d.get(tid)
        top = sorted((x for x in d.items() if x[1].rank <= k), key=lambda x: x[1].rank)[:k]
        content.append(P.ChatLogprobContent(
            token=text, logprob=chosen.logprob if chosen is not None else float("-inf"),
            bytes=list(text.encode()),
            top_logprobs=[P.ChatTopLogprob(token=state.token_text(t), logprob=v.logprob,
                                           bytes=list(state.token_text(t).encode())) for t, v in top]))
    return P.ChatCompletionLogProbs(content=content)


# ---- routes --------------------------------------------------------------------------------------


async def completions(request: Request) -> Response:
    state = _state(request)
    req = await parse_body(request, P.CompletionRequest)
    state.check_model(req.model)
    try:
        params = req.to_sampling_params()
    except P.RequestError as e:
        raise bad_request(e.message, e.param) from None
    prompts = req.prompts()
    token_ids = await _tokenize(state, prompts)
    check_context_length(state.async_llm.engine.max_model_len, [len(t) for t in token_ids],
                         req.requested_max_tokens(), "prompt")
    engine_prompts = [{"prompt_token_ids": ids, "prompt": p} if isinstance(p, str) else {"prompt_token_ids": ids}
                      for p, ids in zip(prompts, token_ids)]
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await _add_all(state, request_id, engine_prompts, params, "prompt", req.cache_salt)
    model = req.model or state.served_model_name
    created = int(time.time())
    n = params.n
    k = req.logprobs
    holdback = _holdback(params)
    echo_text = [p if isinstance(p, str) else state.async_llm.tokenizer.decode(p) for p in prompts] if req.echo else None

    if req.stream:
        include_usage, continuous = _usage_flags(req.stream_options)

        async def gen() -> AsyncIterator[str]:
            cursors = [[_ChoiceCursor() for _ in range(n)] for _ in prompts]
            last: list[RequestOutput | None] = [None] * len(prompts)
            async for pi, out in _merged(streams):
                last[pi] = out
                choices = []
                for c in out.outputs:
                    cur = cursors[pi][c.index]
                    if cur.done:
                        continue
                    text, t0, t1 = _delta(cur, c, holdback)
                    if not cur.started and echo_text is not None:
                        text = echo_text[pi] + text
                    cur.started = True
                    finished = c.finish_reason is not None
                    if not text and t0 == t1 and not finished:
                        continue
                    lp = _completion_logprobs(state, c, k, t0, t1, cur.text_len - len(text)) if k is not None else None
                    choices.append(P.CompletionResponseChoice(
                        index=pi * n + c.index, text=text, logprobs=lp,
                        finish_reason=c.finish_reason if finished else None,
                        stop_reason=c.stop_reason if finished else None))
                    cur.done = finished
                if choices:
                    chunk = P.CompletionStreamResponse(id=request_id, created=created, model=model,
                                                       choices=choices)
                    if include_usage and continuous:
                        chunk.usage = _usage(last)
                    yield _sse(chunk)
            if include_usage:
                yield _sse(P.CompletionStreamResponse(id=request_id, created=created, model=model,
                                                      choices=[], usage=_usage(last)))

        return _event_stream(gen(), streams, "prompt")

    async def collect() -> list[RequestOutput]:
        final: list[RequestOutput | None] = [None] * len(streams)
        async for pi, out in _merged(streams):
            final[pi] = out
        return final  # type: ignore[return-value]

    try:
        finals = await _unless_disconnected(request, collect(), streams)
    except (EngineDeadError, EngineGenerateError) as e:
        raise _engine_error(e, "prompt") from None
    if finals is None:
        return Response(status_code=499)
    choices = []
    for pi, out in enumerate(finals):
        for c in sorted(out.outputs, key=lambda c: c.index):
            text = c.text if echo_text is None else echo_text[pi] + c.text
            lp = _completion_logprobs(state, c, k, 0, len(c.token_ids), 0) if k is not None else None
            choices.append(P.CompletionResponseChoice(index=pi * n + c.index, text=text, logprobs=lp,
                                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    resp = P.CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                usage=_usage(finals))
    return JSONResponse(resp.model_dump())


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    req = await parse_body(request, P.ChatCompletionRequest)
    state.check_model(req.model)
    try:
        params = req.to_sampling_params()
        conversation = req.conversation()
    except P.RequestError as e:
        raise bad_request(e.message, e.param) from None
    tok = state.async_llm.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer, so no chat template", "messages")

    def render() -> tuple[str, list[int]]:
        text = tok.apply_chat_template(conversation, add_generation_prompt=req.add_generation_prompt)
        return text, tok.encode(text, add_special_tokens=False)

    try:
        text, token_ids = await asyncio.to_thread(render)  # off the event loop (huge prompts)
    except Exception as e:
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
    check_context_length(state.async_llm.engine.max_model_len, [len(token_ids)],
                         req.requested_max_tokens(), "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await _add_all(state, request_id, [{"prompt_token_ids": token_ids, "prompt": text}],
                             params, "messages", req.cache_salt)
    model = req.model or state.served_model_name
    created = int(time.time())
    n = params.n
    k = params.logprobs
    holdback = _holdback(params)

    if req.stream:
        include_usage, continuous = _usage_flags(req.stream_options)

        async def gen() -> AsyncIterator[str]:
            cursors = [_ChoiceCursor() for _ in range(n)]
            last: RequestOutput | None = None
            # The role first, for every choice (OpenAI sends it before any content).
            yield _sse(P.ChatCompletionStreamResponse(
                id=request_id, created=created, model=model,
                choices=[P.ChatCompletionStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                         for i in range(n)]))
            async for _, out in _merged(streams):
                last = out
                choices = []
                for c in out.outputs:
                    cur = cursors[c.index]
                    if cur.done:
                        continue
                    text, t0, t1 = _delta(cur, c, holdback)
                    finished = c.finish_reason is not None
                    if not text and t0 == t1 and not finished:
                        continue
                    lp = _chat_logprobs(state, c, k, t0, t1) if k is not None else None
                    choices.append(P.ChatCompletionStreamChoice(
                        index=c.index, delta=P.DeltaMessage(content=text) if text else P.DeltaMessage(),
                        logprobs=lp, finish_reason=c.finish_reason if finished else None,
                        stop_reason=c.stop_reason if finished else None))
                    cur.done = finished
                if choices:
                    chunk = P.ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                           choices=choices)
                    if include_usage and continuous:
                        chunk.usage = _usage([last])
                    yield _sse(chunk)
            if include_usage:
                yield _sse(P.ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                          choices=[], usage=_usage([last])))

        return _event_stream(gen(), streams, "messages")

    async def collect() -> RequestOutput:
        final = None
        async for _, out in _merged(streams):
            final = out
        return final  # type: ignore[return-value]

    try:
        final = await _unless_disconnected(request, collect(), streams)
    except (EngineDeadError, EngineGenerateError) as e:
        raise _engine_error(e, "messages") from None
    if final is None:
        return Response(status_code=499)
    choices = [P.ChatCompletionResponseChoice(
        index=c.index, message=P.ChatResponseMessage(content=c.text),
        logprobs=_chat_logprobs(state, c, k, 0, len(c.token_ids)) if k is not None else None,
        finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in sorted(final.outputs, key=lambda c: c.index)]
    resp = P.ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                    usage=_usage([final]))
    return JSONResponse(resp.model_dump())


async def list_models(request: Request) -> Response:
    state = _state(request)
    eng = state.async_llm.engine
    card = P.ModelCard(id=state.served_model_name, created=int(state.started),
                       root=str(eng.config.model) if eng.config.model else state.served_model_name,
                       max_model_len=eng.max_model_len)
    return JSONResponse(P.ModelList(data=[card]).model_dump())


async def health(request: Request) -> Response:
    state = _state(request)
    if not state.async_llm.is_healthy:
        return APIError(503, "the engine is not running", "server_error", None, "engine_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)}).response()
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def reset_prefix_cache(request: Request) -> Response:
    state = _state(request)
    try:
        ok = await state.async_llm.run_in_engine(lambda e: e.kv_cache_manager.reset_prefix_cache())
    except EngineDeadError as e:
        raise _engine_error(e, "") from None
    if not ok:
        raise APIError(409, "the prefix cache cannot be reset while requests hold KV blocks; "
                       "retry when the server is idle", "conflict_error", None, "blocks_in_use")
    return JSONResponse({"success": True})


# ---- ASGI middleware: access log, API key, body size ------------------------------------------
# Plain ASGI (not BaseHTTPMiddleware): they see every byte of the body as it arrives and never
# buffer a streamed response.

ASGIApp = Any  # (scope, receive, send) -> Awaitable[None]


class AccessLogMiddleware:
    """One ``pagedkv.access`` line at INFO per HTTP request: client, method, path, status and
    the time until the response (a stream: its end) was sent."""

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
            access_logger.info('%s - "%s %s" %d %.1f ms', f"{client[0]}:{client[1]}" if client else "-",
                               scope["method"], scope["path"], status, (time.perf_counter() - t0) * 1e3)


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
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self.authorized(scope):
            err = APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                           "invalid_request_error", None, "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class MaxBodySizeMiddleware:
    """413 (OpenAI's error JSON) for a request body over ``max_bytes``: at once when its
    ``Content-Length`` says so; a chunked body (no length) is read up to the limit first and
    refused as soon as it passes it, so that no body bigger than the limit is ever held."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} "
                        "bytes (pagedkv serve --max-request-bytes)", "invalid_request_error", None,
                        "request_too_large", headers={"Connection": "close"})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if length is not None:
            # The server (h11/httptools) already holds the body to its declared length.
            if length.strip().isdigit() and int(length) > self.max_bytes:
                await self.too_large().response()(scope, receive, send)
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
                await self.too_large().response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> dict[str, Any]:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)


# ---- app -----------------------------------------------------------------------------------------


def check_server_options(api_key: str | None, max_request_bytes: int | None) -> None:
    """ValueError naming the option when ``api_key`` is empty or ``max_request_bytes`` < 1."""
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string (or None for no authentication)")
    if max_request_bytes is not None and max_request_bytes < 1:
        raise ValueError(f"invalid max_request_bytes {max_request_bytes}: must be >= 1")


def build_app(async_llm: AsyncLLM, *, served_model_name: str | None = None,
              kv_event_publisher: Any = None, owns_engine: bool = True, api_key: str | None = None,
              max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app serving ``async_llm``. With ``owns_engine`` the app shuts the engine
    (and the event publisher) down when it stops. With ``api_key`` every route but
    `OPEN_PATHS` needs ``Authorization: Bearer <api_key>``; bodies over ``max_request_bytes``
    (None: no limit) get 413. Every request is logged on ``pagedkv.access`` at INFO."""
    check_server_options(api_key, max_request_bytes)
    from pagedkv.entrypoints import dashboard

    engine = async_llm.engine
    name = served_model_name or default_model_name(engine.config.model)
    aliases = {name}
    if engine.config.model:
        aliases.add(str(engine.config.model))
    metrics_ = ServerMetrics(async_llm, name)
    async_llm.stat_loggers.append(metrics_)
    if kv_event_publisher is not None and async_llm.event_publisher is None:
        async_llm.event_publisher = kv_event_publisher
    state = ServerState(async_llm, name, aliases, metrics_, kv_event_publisher)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            await asyncio.to_thread(async_llm.shutdown)

    app = FastAPI(title="pagedkv OpenAI-compatible server", lifespan=lifespan)
    app.state.pagedkv = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_, None, exc.status_code,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return APIError(500, f"internal error: {exc!r}", "internal_server_error", None,
                        "internal_error").response()

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    dashboard.add_routes(app)
    # The last added runs first: log everything, then authenticate, then read the body.
    if max_request_bytes is not None:
        app.add_middleware(MaxBodySizeMiddleware, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(AccessLogMiddleware)
    return app


def default_model_name(model: str | Path | None) -> str:
    if not model:
        return DEFAULT_MODEL_NAME
    p = Path(str(model))
    return p.stem if p.suffix == ".gguf" else p.name or str(model)


@dataclass
class KVEventsOptions:
    """``--enable-kv-cache-events`` and friends."""

    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    topic: str = ""


def create_app(config: Any = None, *, served_model_name: str | None = None,
               max_queue_size: int | None = None, kv_events: KVEventsOptions | None = None,
               engine: Any = None, api_key: str | None = None,
               max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """Load the engine (an `EngineConfig`, or an existing ``engine``), start the engine loop
    and the KV event publisher (when ``kv_events`` is given; it forces
    ``enable_kv_cache_events``) and return the app (``api_key``, ``max_request_bytes``: see
    `build_app`)."""
    from dataclasses import replace

    from pagedkv.engine.async_llm import DEFAULT_MAX_QUEUE_SIZE
    from pagedkv.engine.config import EngineConfig

    check_server_options(api_key, max_request_bytes)  # before the engine starts
    queue_size = DEFAULT_MAX_QUEUE_SIZE if max_queue_size is None else max_queue_size
    publisher = None
    if engine is None:
        config = config or EngineConfig()
        if kv_events is not None and not config.enable_kv_cache_events:
            config = replace(config, enable_kv_cache_events=True)
        if kv_events is not None:  # bind first: a busy port fails before the model loads
            publisher = _make_publisher(kv_events)
        try:
            # The engine is built on its own thread (see AsyncLLM): faster steps on CPU.
            async_llm = AsyncLLM(config=config, max_queue_size=queue_size, event_publisher=publisher)
        except BaseException:
            if publisher is not None:
                publisher.shutdown()
            raise
    else:
        if kv_events is not None:
            if not engine.config.enable_kv_cache_events:
                raise ValueError("kv_events needs an engine built with enable_kv_cache_events=True")
            publisher = _make_publisher(kv_events)
        async_llm = AsyncLLM(engine, max_queue_size=queue_size, event_publisher=publisher)
    return build_app(async_llm, served_model_name=served_model_name, kv_event_publisher=publisher,
                     api_key=api_key, max_request_bytes=max_request_bytes)


def _make_publisher(opts: KVEventsOptions) -> Any:
    from pagedkv.entrypoints.kv_events import ZmqEventPublisher

    return ZmqEventPublisher(opts.endpoint, opts.replay_endpoint, buffer_steps=opts.buffer_steps,
                             topic=opts.topic)

