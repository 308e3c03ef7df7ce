"""The OpenAI-compatible HTTP server (FastAPI): `build_app` / `create_app` and the routes.

Routes:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``: streaming (SSE, ``data: {...}``
  chunks then ``data: [DONE]``) or not; ``n``, ``stop``, ``seed``, ``max_tokens``,
  ``temperature``, ``top_p``, ``logprobs``, ``stream_options.include_usage`` and vLLM's
  sampling extensions (see protocol.py). ``usage.prompt_tokens_details.cached_tokens`` counts
  the prompt tokens served from the prefix cache. A completions ``prompt`` may be a list of
  prompts (choice ``index = prompt_index * n + sample_index``).
* ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (opt-in): vLLM's shapes,
  see serving_tokenization.py; ``GET /version``; ``GET|POST /ping`` (as ``/health``).
* ``GET /v1/models``, ``GET /health`` (503 once the engine failed), ``GET /metrics``
  (Prometheus, see metrics.py), ``POST /reset_prefix_cache`` (409 while requests hold blocks),
  ``GET /debug/kv_cache`` (the pool's counts and an invariant check: `debug_kv_cache`),
  ``GET /v1/kv_cache_config`` (block size, hash algorithm and seed, KV event endpoints: what
  ``pagedkv router`` reads, see `kv_cache_config`),
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

Modules::

    api_server.py          the app factory, small routes      errors.py      OpenAI error JSON
    serving_completion.py  /v1/completions                    validation.py  body → request, or 400
    serving_chat.py        /v1/chat/completions               streaming.py   SSE, disconnects
    serving_engine.py      the generate-collect path both     middleware.py  access log, API key,
                           endpoints share                                   body size
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedkv.engine.async_llm import AsyncLLM, EngineDeadError
from pagedkv.entrypoints.metrics import ServerMetrics
from pagedkv.entrypoints.openai import openapi
from pagedkv.entrypoints.openai import protocol as P
from pagedkv.entrypoints.openai import serving_tokenization as tokenization
from pagedkv.entrypoints.openai.errors import (
    APIError,
    engine_error,
    install_exception_handlers,
    unavailable,
)
from pagedkv.entrypoints.openai.middleware import (
    AccessLogMiddleware,
    APIKeyMiddleware,
    MaxBodySizeMiddleware,
    RequestIdMiddleware,
)
from pagedkv.entrypoints.openai.serving_chat import create_chat_completion, create_encode
from pagedkv.entrypoints.openai.serving_completion import create_completion
from pagedkv.entrypoints.openai.serving_engine import ServerState, server_state

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


# ---- routes --------------------------------------------------------------------------------------


async def list_models(request: Request) -> Response:
    state = server_state(request)
    eng = state.async_llm.engine
    card = P.ModelCard(
        id=state.served_model_name,
        created=int(state.started),
        root=str(eng.config.model) if eng.config.model else state.served_model_name,
        max_model_len=eng.max_model_len,
    )
    return JSONResponse(P.ModelList(data=[card]).model_dump())


async def health(request: Request) -> Response:
    state = server_state(request)
    if not state.async_llm.is_healthy:
        return unavailable("the engine is not running", "engine_unavailable").response()
    return JSONResponse({"status": "ok"})


async def version(request: Request) -> Response:
    from pagedkv import __version__

    return JSONResponse(P.VersionResponse(version=__version__).model_dump())


async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def reset_prefix_cache(request: Request) -> Response:
    state = server_state(request)
    try:
        ok = await state.async_llm.run_in_engine(lambda e: e.kv_cache_manager.reset_prefix_cache())
    except EngineDeadError as e:
        raise engine_error(e, "") from None
    if not ok:
        raise APIError(
            409,
            "the prefix cache cannot be reset while requests hold KV blocks; "
            "retry when the server is idle",
            "conflict_error",
            None,
            "blocks_in_use",
        )
    return JSONResponse({"success": True})


async def debug_kv_cache(request: Request) -> Response:
    """An operator's leak check: the KV pool's counts and `LLMEngine.check_invariants`, run on the
    engine thread between two steps. Returns ``{"num_blocks", "num_free_blocks", "num_running",
    "num_waiting", "invariants_ok": true}``; when the check fails, ``invariants_ok`` is false and
    ``"error"`` is its AssertionError's message (still 200: the answer is the finding).
    ``num_blocks`` counts the reserved null block, so an idle server (nothing running, waiting
    or held for a KV transfer) has ``num_free_blocks == num_blocks - 1``. O(num_blocks)."""
    state = server_state(request)

    def check(e: LLMEngine) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_blocks": e.kv_cache_config.num_blocks,
            "num_free_blocks": e.kv_cache_manager.num_free_blocks,
            "num_running": e.scheduler.num_running,
            "num_waiting": e.scheduler.num_waiting,
            "invariants_ok": True,
        }
        try:
            e.check_invariants()
        except AssertionError as err:
            out.update(invariants_ok=False, error=str(err))
        return out

    try:
        return JSONResponse(await state.async_llm.run_in_engine(check))
    except EngineDeadError as e:
        raise engine_error(e, "") from None


@functools.lru_cache(maxsize=8)
def _model_identity(path: str) -> str:
    """`model_identity` once per path (it reads the weights' first MiBs; a router polls)."""
    from pagedkv.models.loader import model_identity

    return model_identity(path)


async def kv_cache_config(request: Request) -> Response:
    """What a KV-aware router needs to mirror this server's prefix cache (``pagedkv router``
    refuses a replica whose answer differs from the others'): ``block_size``, ``hash_algo`` and
    ``hash_seed`` (the NONE_HASH seed: with them a client recomputes the block hashes of the KV
    events), ``model`` (the served name), ``model_path`` and ``model_identity`` (which weights),
    ``tokenizer`` (a digest of vocab size, special ids and chat template), ``num_blocks``,
    ``kv_cache_medium``, ``enable_prefix_caching``, ``kv_cache_groups`` (each KV cache group's
    kind, layers, block size, window or chunk and page size: `dashboard.kv_cache_groups_info`),
    ``started`` (the server's start time: a
    router notices a restart) and ``kv_events`` (``{"endpoint",
    "replay_endpoint", "topic"}``, or null without a publisher). Note: with xxhash the seed is the
    per-process random one; this route is behind ``api_key`` like every non-open route."""
    import hashlib

    from pagedkv.core.hashing import get_hash_fn_by_name, resolve_none_hash_seed
    from pagedkv.entrypoints.dashboard import kv_cache_groups_info
    from pagedkv.models.loader import resolve_model_path

    state = server_state(request)
    eng = state.async_llm.engine
    cfg = eng.config
    path = resolve_model_path(cfg.model)
    tok = eng.tokenizer
    tok_desc = (
        None
        if tok is None
        else json.dumps(
            [tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.chat_template], default=str
        )
    )
    pub = state.kv_event_publisher
    return JSONResponse(
        {
            "model": state.served_model_name,
            "model_path": str(path),
            "model_identity": await asyncio.to_thread(_model_identity, str(path)),
            "tokenizer": None
            if tok_desc is None
            else hashlib.sha256(tok_desc.encode()).hexdigest()[:16],
            "block_size": cfg.block_size,
            "hash_algo": cfg.prefix_caching_hash_algo,
            "hash_seed": resolve_none_hash_seed(get_hash_fn_by_name(cfg.prefix_caching_hash_algo)),
            "num_blocks": eng.kv_cache_config.num_blocks,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "kv_cache_medium": eng.kv_cache_manager.block_pool.medium,
            "started": state.started,
            "kv_cache_groups": kv_cache_groups_info(eng),
            "kv_events": None
            if pub is None
            else {
                "endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint,
                "topic": pub.topic.decode(),
            },
        }
    )


# ---- app -----------------------------------------------------------------------------------------


def check_server_options(api_key: str | None, max_request_bytes: int | None) -> None:
    """ValueError naming the option when ``api_key`` is empty or ``max_request_bytes`` < 1."""
    if api_key is not None and not api_key:
        raise ValueError("api_key must be a non-empty string (or None for no authentication)")
    if max_request_bytes is not None and max_request_bytes < 1:
        raise ValueError(f"invalid max_request_bytes {max_request_bytes}: must be >= 1")


def build_app(
    async_llm: AsyncLLM,
    *,
    served_model_name: str | None = None,
    kv_event_publisher: Any = None,
    owns_engine: bool = True,
    api_key: str | None = None,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    enable_tokenizer_info_endpoint: bool = False,
    allowed_local_media_path: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``async_llm``. ``allowed_local_media_path``: the directory
    whose files chat ``image_url`` parts may name (None: data: URLs only). With
    ``owns_engine`` the app shuts the engine
    (and the event publisher) down when it stops. With ``api_key`` every route but
    `OPEN_PATHS` needs ``Authorization: Bearer <api_key>``; bodies over ``max_request_bytes``
    (None: no limit) get 413. ``GET /tokenizer_info`` answers only with
    ``enable_tokenizer_info_endpoint``. Every request is logged on ``pagedkv.access`` at INFO."""
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
    state = ServerState(
        async_llm,
        name,
        aliases,
        metrics_,
        kv_event_publisher,
        enable_tokenizer_info=enable_tokenizer_info_endpoint,
        allowed_local_media_path=allowed_local_media_path,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            await asyncio.to_thread(async_llm.shutdown)

    app = FastAPI(title="pagedkv OpenAI-compatible server", lifespan=lifespan)
    app.state.pagedkv = state

    install_exception_handlers(app)
    app.add_api_route("/v1/completions", create_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])
    ec = async_llm.engine.ec
    if ec is not None and ec.producer is not None:  # an encoder instance (EPD)
        app.add_api_route("/v1/encode", create_encode, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])  # SageMaker's probe, as vLLM's
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/tokenize", tokenization.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenization.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenization.tokenizer_info, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    app.add_api_route("/debug/kv_cache", debug_kv_cache, methods=["GET"])
    app.add_api_route("/v1/kv_cache_config", kv_cache_config, methods=["GET"])
    dashboard.add_routes(app)
    openapi.install(app)
    # The last added runs first: log everything, give it an id, authenticate, read the body.
    if max_request_bytes is not None:
        app.add_middleware(MaxBodySizeMiddleware, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)
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


def create_app(
    config: Any = None,
    *,
    served_model_name: str | None = None,
    max_queue_size: int | None = None,
    kv_events: KVEventsOptions | None = None,
    engine: Any = None,
    api_key: str | None = None,
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES,
    enable_tokenizer_info_endpoint: bool = False,
    allowed_local_media_path: str | None = None,
) -> FastAPI:
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
            async_llm = AsyncLLM(
                config=config, max_queue_size=queue_size, event_publisher=publisher
            )
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
    return build_app(
        async_llm,
        served_model_name=served_model_name,
        kv_event_publisher=publisher,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint,
        allowed_local_media_path=allowed_local_media_path,
    )


def _make_publisher(opts: KVEventsOptions) -> Any:
    from pagedkv.core.event_transport import ZmqEventPublisher

    return ZmqEventPublisher(
        opts.endpoint, opts.replay_endpoint, buffer_steps=opts.buffer_steps, topic=opts.topic
    )
