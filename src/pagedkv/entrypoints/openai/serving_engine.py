"""The generate-collect path shared by ``/v1/completions`` and ``/v1/chat/completions``.

An endpoint (serving_completion.py, serving_chat.py) validates its request, builds the prompts
and a `ChoiceRenderer`, queues the prompts (`add_all`) and hands the streams to
`generate_response`, which either streams SSE chunks or collects the final outputs:

::

    request ─▶ prompts ─▶ add_all ─▶ streams ─▶ generate_response ─┬─ stream: deltas ─▶ SSE chunks
                                                                  └─ collect: finals ─▶ JSON

The renderer says only what differs between the endpoints: the choice and response models,
choice indices, echo, logprobs, a chat stream's leading role chunk. The rest (stop-string
holdback, skipping empty deltas, usage, errors, aborting on disconnect) is here, once.

``kv_transfer_params`` (vLLM's PD field): the KV connector's params of the finished request go
on the response's top level (the first prompt's, as vLLM does; null without a connector), and
on the last chunk of a stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from pagedkv.engine.async_llm import AsyncLLM, EngineDeadError, EngineGenerateError, RequestStream
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling_params import SamplingParamError, SamplingParams
from pagedkv.entrypoints.metrics import ServerMetrics
from pagedkv.entrypoints.openai import protocol as P
from pagedkv.entrypoints.openai.errors import APIError, bad_request, engine_error
from pagedkv.entrypoints.openai.streaming import event_stream, merged, sse, unless_disconnected

# Token texts cached per server (logprobs decode one token at a time).
MAX_TOKEN_TEXT_CACHE = 200_000


@dataclass
class ServerState:
    """What the routes share (``app.state.pagedkv``)."""

    async_llm: AsyncLLM
    served_model_name: str
    model_aliases: set[str]
    metrics: ServerMetrics
    kv_event_publisher: Any = None
    enable_tokenizer_info: bool = False  # GET /tokenizer_info answers (vLLM's opt-in flag)
    started: float = field(default_factory=time.time)
    token_text_cache: dict[int, str] = field(default_factory=dict)
    allowed_local_media_path: str | None = None  # files chat image parts may name

    @property
    def image_placeholder(self) -> str | None:
        """The model's image token as template text (None: the model takes no images)."""
        engine = self.async_llm.engine
        tok = self.async_llm.tokenizer
        if engine.mm_processor is None or tok is None:
            return None
        return tok.id_to_token(engine.mm_processor.image_token_id)

    def image_source(self, url: str) -> str:
        """A chat ``image_url`` as the engine takes it: a data: URL as it is, a local file only
        under ``allowed_local_media_path``; a 400 naming ``messages`` otherwise."""
        if url.startswith("data:"):
            return url
        if url.startswith(("http://", "https://")):
            raise bad_request("image URLs are not fetched: send a data: URL", "messages")
        root = self.allowed_local_media_path
        path = Path(url.removeprefix("file://"))
        if root is None or not path.resolve().is_relative_to(Path(root).resolve()):
            raise bad_request(
                "local image files are allowed only under --allowed-local-media-path", "messages"
            )
        return str(path)

    def token_text(self, token_id: int) -> str:
        """The text of one token (special tokens included), cached."""
        s = self.token_text_cache.get(token_id)
        if s is None:
            tok = self.async_llm.tokenizer
            s = (
                tok.decode([token_id], skip_special_tokens=False)
                if tok is not None
                else str(token_id)
            )
            if len(self.token_text_cache) < MAX_TOKEN_TEXT_CACHE:
                self.token_text_cache[token_id] = s
        return s

    def check_model(self, name: str | None) -> None:
        """404 ``model_not_found`` unless ``name`` is None or one of the served names."""
        if name is not None and name not in self.model_aliases:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves "
                f"'{self.served_model_name}'.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )


def server_state(request: Request) -> ServerState:
    return request.app.state.pagedkv


def request_id(request: Request) -> str:
    """This request's id: the client's ``x-request-id`` or a fresh one (`RequestIdMiddleware`)."""
    return getattr(request.state, "request_id", None) or uuid.uuid4().hex


# ---- prompts ------------------------------------------------------------------------------------


async def tokenize(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
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


async def add_all(
    state: ServerState,
    base_id: str,
    prompts: list[Any],
    params: SamplingParams,
    prompt_param: str,
    cache_salt: str | None = None,
    structured_field: str = "structured_outputs",
) -> list[RequestStream]:
    """Queue every prompt (all or none: a failure aborts those already queued and becomes an
    `APIError` naming ``prompt_param``, or ``structured_field``, the request field of a
    grammar that does not compile). One prompt keeps ``base_id``; several get
    ``base_id-<i>``."""
    streams: list[RequestStream] = []
    arrival = time.monotonic()
    try:
        for i, prompt in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(
                await state.async_llm.add_request(
                    rid, prompt, params, arrival, cache_salt=cache_salt
                )
            )
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, asyncio.CancelledError):
            raise
        if isinstance(e, SamplingParamError) and e.param == "structured_outputs":
            raise bad_request(str(e), structured_field) from None
        raise engine_error(e, prompt_param) from None
    return streams


# ---- deltas -------------------------------------------------------------------------------------


@dataclass(slots=True)
class ChoiceCursor:
    """What one choice has streamed so far."""

    text_len: int = 0
    num_tokens: int = 0
    started: bool = False
    done: bool = False

    def advance(self, c: CompletionOutput, holdback: int) -> tuple[str, int, int]:
        """``(new text, first new token, end token)`` of choice ``c`` since the last call. While
        ``c`` runs, its last ``holdback`` characters are held back."""
        text = c.text
        end = len(text) if c.finish_reason is not None else max(len(text) - holdback, self.text_len)
        new_text = text[self.text_len : end]
        tok0, tok1 = self.num_tokens, len(c.token_ids)
        self.text_len = end
        self.num_tokens = tok1
        return new_text, tok0, tok1


def stop_holdback(params: SamplingParams) -> int:
    """Characters to hold back while streaming: a stop string may be forming at the end of the
    text, and the engine cuts it when it completes (vLLM's stop buffer)."""
    if not params.stop_strings or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop_strings) - 1


def usage_info(outs: list[RequestOutput | None]) -> P.UsageInfo:
    """Token counts of ``outs`` (prompt tokens served from the prefix cache as cached_tokens)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs if o is not None)
    completion = sum(len(c.token_ids) for o in outs if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs if o is not None)
    return P.UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached),
    )


# ---- one path for both endpoints ---------------------------------------------------------------


class ChoiceRenderer(ABC):
    """What an endpoint's responses look like. ``pi`` is the prompt index, ``c`` one of its
    choices; ``text`` a choice's text (a delta while streaming), ``t0:t1`` its tokens."""

    #: The request field holding the prompt, named by errors ("prompt", "messages").
    prompt_param: str
    #: Where ``return_token_ids`` puts ``prompt_token_ids``: on each choice (completions, whose
    #: choices may come from different prompts) or on the response (chat), as vLLM does.
    prompt_ids_on_choice: bool = True

    def echo(self, pi: int) -> str:
        """Text that precedes prompt ``pi``'s choices (completions' ``echo``)."""
        return ""

    def observe(self, pi: int, out: RequestOutput) -> None:
        """Called with prompt ``pi``'s latest output before its choices are rendered
        (completions keep its ``prompt_logprobs``)."""

    def stream_prelude(self) -> list[BaseModel]:
        """Chunks sent before any output (chat: the role of every choice)."""
        return []

    @abstractmethod
    def stream_choice(
        self,
        pi: int,
        c: CompletionOutput,
        text: str,
        t0: int,
        t1: int,
        text_offset: int,
        finished: bool,
    ) -> BaseModel:
        """One choice of a chunk; ``text_offset``: where ``text`` starts in the choice."""

    @abstractmethod
    def stream_chunk(
        self, choices: list[BaseModel], usage: P.UsageInfo | None = None
    ) -> BaseModel: ...

    @abstractmethod
    def final_choice(self, pi: int, c: CompletionOutput, text: str) -> BaseModel: ...

    @abstractmethod
    def response(
        self,
        choices: list[BaseModel],
        usage: P.UsageInfo,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> BaseModel: ...


async def generate_response(
    request: Request,
    renderer: ChoiceRenderer,
    streams: list[RequestStream],
    params: SamplingParams,
    stream: bool,
    stream_options: P.StreamOptions | None,
    return_token_ids: bool = False,
) -> Response:
    """The response to queued ``streams`` (one per prompt): SSE chunks then ``[DONE]`` when
    ``stream``, else one JSON response once every request finished (499, requests aborted,
    if the client leaves first). Engine failures are OpenAI errors naming the prompt field.
    ``return_token_ids``: token ids ride along (see `_SamplingRequest.return_token_ids`)."""
    if stream:
        return event_stream(
            _chunks(renderer, streams, params, stream_options, return_token_ids),
            streams,
            renderer.prompt_param,
        )
    try:
        finals = await unless_disconnected(request, _collect(streams), streams)
    except (EngineDeadError, EngineGenerateError) as e:
        raise engine_error(e, renderer.prompt_param) from None
    if finals is None:
        return Response(status_code=499)
    choices = []
    for pi, out in enumerate(finals):
        renderer.observe(pi, out)
        for c in sorted(out.outputs, key=lambda c: c.index):
            choice = renderer.final_choice(pi, c, renderer.echo(pi) + c.text)
            if return_token_ids:
                _add_token_ids(renderer, None, choice, out, list(c.token_ids), True)
            choices.append(choice)
    body = renderer.response(choices, usage_info(finals), finals[0].kv_transfer_params)  # type: ignore[arg-type]
    if return_token_ids and not renderer.prompt_ids_on_choice:
        body.prompt_token_ids = list(finals[0].prompt_token_ids)  # type: ignore[attr-defined]
    return JSONResponse(body.model_dump())


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of every stream, in prompt order."""
    final: list[RequestOutput | None] = [None] * len(streams)
    async for pi, out in merged(streams):
        final[pi] = out
    return final  # type: ignore[return-value]


def _add_token_ids(
    renderer: ChoiceRenderer,
    chunk: BaseModel | None,
    choice: BaseModel,
    out: RequestOutput,
    token_ids: list[int],
    first: bool,
) -> None:
    """``return_token_ids``: ``token_ids`` on ``choice``; in a choice's first chunk (or the
    final response) its prompt's ``prompt_token_ids``, on the choice or on ``chunk``."""
    choice.token_ids = token_ids  # type: ignore[attr-defined]
    if first and renderer.prompt_ids_on_choice:
        choice.prompt_token_ids = list(out.prompt_token_ids)  # type: ignore[attr-defined]
    elif first and chunk is not None:
        chunk.prompt_token_ids = list(out.prompt_token_ids)  # type: ignore[attr-defined]


async def _chunks(
    renderer: ChoiceRenderer,
    streams: list[RequestStream],
    params: SamplingParams,
    stream_options: P.StreamOptions | None,
    return_token_ids: bool = False,
) -> AsyncIterator[str]:
    """SSE events of the streamed choices: one chunk per engine output that moved any choice
    (text, tokens or its finish), ``usage`` in each (``continuous_usage_stats``) and in a last
    chunk without choices (``include_usage``). The last chunk also has ``kv_transfer_params``."""
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = bool(stream_options and stream_options.continuous_usage_stats)
    holdback = stop_holdback(params)
    cursors = [[ChoiceCursor() for _ in range(params.n)] for _ in streams]
    last: list[RequestOutput | None] = [None] * len(streams)
    kv_sent = False
    for chunk in renderer.stream_prelude():
        yield sse(chunk)
    async for pi, out in merged(streams):
        last[pi] = out
        renderer.observe(pi, out)
        moved = []  # (choice, its output, its first new token, whether it is the choice's first chunk)
        for c in out.outputs:
            cur = cursors[pi][c.index]
            t0, first = cur.num_tokens, not cur.started
            if (choice := _stream_choice(renderer, pi, c, cur, holdback)) is not None:
                moved.append((choice, c, t0, first))
        choices = [m[0] for m in moved]
        if choices:
            chunk = renderer.stream_chunk(
                choices, usage_info(last) if include_usage and continuous else None
            )
            for choice, c, t0, first in moved if return_token_ids else ():
                _add_token_ids(renderer, chunk, choice, out, list(c.token_ids[t0:]), first)
            # Without a usage chunk to come, the chunk in which every request finished is the last.
            if not include_usage and all(o is not None and o.finished for o in last):
                chunk.kv_transfer_params = last[0].kv_transfer_params  # type: ignore[union-attr, attr-defined]
                kv_sent = True
            yield sse(chunk)
    if include_usage or not kv_sent:
        chunk = renderer.stream_chunk([], usage_info(last) if include_usage else None)
        chunk.kv_transfer_params = last[0].kv_transfer_params if last[0] is not None else None  # type: ignore[attr-defined]
        yield sse(chunk)


def _stream_choice(
    renderer: ChoiceRenderer, pi: int, c: CompletionOutput, cur: ChoiceCursor, holdback: int
) -> BaseModel | None:
    """Choice ``c``'s part of the next chunk, or None when it has nothing new."""
    if cur.done:
        return None
    text, t0, t1 = cur.advance(c, holdback)
    if not cur.started:
        text = renderer.echo(pi) + text
        cur.started = True
    finished = c.finish_reason is not None
    if not text and t0 == t1 and not finished:
        return None
    cur.done = finished
    return renderer.stream_choice(pi, c, text, t0, t1, cur.text_len - len(text), finished)
