"""The OpenAPI document (``/openapi.json``, ``/docs``): protocol.py's models, every status code.

The routes parse their bodies themselves (`validation.parse_body`: OpenAI's 400 JSON naming the
field, not FastAPI's 422), so FastAPI cannot see their request models. This module says, per
route, which model is the body, which model or media type each status answers with, and adds
them to FastAPI's document: the pydantic models in protocol.py are the one definition used for
validation, parsing and the document. Every operation also declares the optional
``x-request-id`` header and the ``X-Request-Id`` response header (`RequestIdMiddleware`).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagedkv.entrypoints.openai import protocol as P

REF = "#/components/schemas/{model}"
JSON = "application/json"
SSE = "text/event-stream"
# Why each status is answered (the error body is always OpenAI's `ErrorResponse`).
ERRORS: dict[int, str] = {
    400: "Invalid request: the field at fault is the error's `param`",
    401: "Missing or wrong API key (`--api-key`)",
    404: "Unknown model, or an endpoint not enabled",
    409: "Conflict: the request id is in flight, or blocks are in use",
    413: "The body is larger than `--max-request-bytes`",
    500: "The request's engine step failed, or an unexpected error",
    503: "The engine is down or the queue is full (`Retry-After`)",
}
# Every operation can answer these: a malformed x-request-id, the API key, the body limit, a bug.
COMMON = (400, 401, 413, 500)


@dataclass(frozen=True, slots=True)
class Route:
    """What one operation takes and answers. ``body``: its request model(s) (several: any of
    them); ``ok``: the 200 body, a model (JSON) or a media type with a plain schema;
    ``stream``: 200 may also be an SSE stream; ``errors``: statuses beyond `COMMON`."""

    body: tuple[type[BaseModel], ...] = ()
    ok: type[BaseModel] | tuple[str, dict[str, Any]] | None = None
    stream: bool = False
    errors: tuple[int, ...] = ()
    summary: str = ""
    chunk: type[BaseModel] | None = None  # a streamed event's JSON (with ``stream``)


OBJECT = (JSON, {"type": "object"})
ROUTES: dict[tuple[str, str], Route] = {
    ("/v1/completions", "post"): Route(
        (P.CompletionRequest,),
        P.CompletionResponse,
        True,
        (404, 409, 503),
        "Completions",
        P.CompletionStreamResponse,
    ),
    ("/v1/chat/completions", "post"): Route(
        (P.ChatCompletionRequest,),
        P.ChatCompletionResponse,
        True,
        (404, 409, 503),
        "Chat completions",
        P.ChatCompletionStreamResponse,
    ),
    ("/v1/encode", "post"): Route(
        (P.ChatCompletionRequest,),
        P.EncodeResponse,
        errors=(404, 503),
        summary="An encoder instance's images encoded and kept for a prefill instance (EPD)",
    ),
    ("/tokenize", "post"): Route(
        (P.TokenizeCompletionRequest, P.TokenizeChatRequest),
        P.TokenizeResponse,
        errors=(404,),
        summary="Text or messages to token ids (vLLM's shape)",
    ),
    ("/detokenize", "post"): Route(
        (P.DetokenizeRequest,), P.DetokenizeResponse, errors=(404,), summary="Ids to text"
    ),
    ("/tokenizer_info", "get"): Route(
        ok=P.TokenizerInfoResponse, errors=(404,), summary="Tokenizer configuration (opt-in)"
    ),
    ("/v1/models", "get"): Route(ok=P.ModelList, summary="The served model"),
    ("/health", "get"): Route(ok=OBJECT, errors=(503,), summary="200 while the engine lives"),
    ("/ping", "get"): Route(ok=OBJECT, errors=(503,), summary="As /health"),
    ("/ping", "post"): Route(ok=OBJECT, errors=(503,), summary="As /health"),
    ("/version", "get"): Route(ok=P.VersionResponse, summary="The package version"),
    ("/metrics", "get"): Route(
        ok=("text/plain", {"type": "string"}), summary="Prometheus exposition format"
    ),
    ("/reset_prefix_cache", "post"): Route(
        ok=OBJECT, errors=(409, 503), summary="Drop the cached blocks"
    ),
    ("/debug/kv_cache", "get"): Route(ok=OBJECT, errors=(503,), summary="Pool invariants"),
    ("/v1/kv_cache_config", "get"): Route(ok=OBJECT, summary="What a KV-aware router mirrors"),
    ("/dashboard/state", "get"): Route(ok=OBJECT, summary="The dashboard's data"),
}


def _models() -> list[tuple[type[BaseModel], str]]:
    out: list[tuple[type[BaseModel], str]] = [(P.ErrorResponse, "serialization")]
    for r in ROUTES.values():
        out += [(m, "validation") for m in r.body]
        if isinstance(r.ok, type):
            out.append((r.ok, "serialization"))
    out += [(P.CompletionStreamResponse, "serialization")]
    out += [(P.ChatCompletionStreamResponse, "serialization")]
    return list(dict.fromkeys(out))


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _responses(route: Route) -> dict[str, Any]:
    header = {
        "X-Request-Id": {
            "description": "The request's id (its own x-request-id, or a fresh one)",
            "schema": {"type": "string"},
        }
    }
    content: dict[str, Any] = {}
    if isinstance(route.ok, type):
        content[JSON] = {"schema": _ref(route.ok)}
    elif route.ok is not None:
        content[route.ok[0]] = {"schema": route.ok[1]}
    if route.stream:  # before Open API 3.2, an event stream's schema describes each event
        content[SSE] = {"schema": _event_schema(route.chunk)}
    out: dict[str, Any] = {"200": {"description": "OK", "headers": header, "content": content}}
    for status in sorted({*COMMON, *route.errors}):
        out[str(status)] = {
            "description": ERRORS[status],
            "headers": header,
            "content": {JSON: {"schema": _ref(P.ErrorResponse)}},
        }
    return out


def _event_schema(chunk: type[BaseModel] | None) -> dict[str, Any]:
    """One SSE event: ``data`` is a JSON chunk (``chunk``), or ``[DONE]`` to end the stream."""
    data: dict[str, Any] = {"type": "string", "contentMediaType": JSON}
    if chunk is not None:
        data["contentSchema"] = _ref(chunk)
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {"anyOf": [{"const": "[DONE]"}, data]},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }


def _body(route: Route) -> dict[str, Any]:
    schemas = [_ref(m) for m in route.body]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"required": True, "content": {JSON: {"schema": schema}}}


REQUEST_ID_PARAM = {
    "name": "x-request-id",
    "in": "header",
    "required": False,
    "description": "The request's id (echoed as X-Request-Id; used as the response id)",
    "schema": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "^[!-~]+$"},
}


# Cross-field rules, stated in JSON Schema (``if``/``then``) where it can say them.
# structured_outputs excludes a non-text response_format (the same constraint, two fields).
_ONE_STRUCTURED = {
    "if": {
        "required": ["structured_outputs"],
        "properties": {"structured_outputs": {"type": "object"}},
    },
    "then": {
        "properties": {
            "response_format": {
                "anyOf": [{"type": "null"}, {"properties": {"type": {"const": "text"}}}]
            }
        }
    },
}
_INT = {"type": "integer"}
IF_THEN: dict[str, list[dict[str, Any]]] = {
    "CompletionRequest": [
        _ONE_STRUCTURED,
        {  # stream_options needs stream: true
            "if": {
                "required": ["stream_options"],
                "properties": {"stream_options": {"type": "object"}},
            },
            "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
        },
    ],
    "ChatCompletionRequest": [
        _ONE_STRUCTURED,
        {
            "if": {
                "required": ["stream_options"],
                "properties": {"stream_options": {"type": "object"}},
            },
            "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
        },
        {  # top_logprobs needs logprobs: true
            "if": {
                "required": ["top_logprobs"],
                "properties": {"top_logprobs": {"type": "integer"}},
            },
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        },
    ],
    "KVEviction": [
        {  # streaming needs a budget or a window, and takes no compress_at
            "if": {"properties": {"policy": {"const": "streaming"}}},
            "then": {
                "anyOf": [
                    {"required": ["budget_tokens"], "properties": {"budget_tokens": _INT}},
                    {"required": ["recent_tokens"], "properties": {"recent_tokens": _INT}},
                ],
                "properties": {"compress_at": {"type": "null"}},
            },
        },
        {  # snapkv and pyramidkv need a budget and keep the original positions
            "if": {"properties": {"policy": {"enum": ["snapkv", "pyramidkv"]}}},
            "then": {
                "required": ["budget_tokens"],
                "properties": {
                    "budget_tokens": _INT,
                    "positions": {"anyOf": [{"type": "null"}, {"const": "original"}]},
                },
            },
        },
        {  # the pooling window is centred: an odd width
            "properties": {"pool_kernel": {"anyOf": [{"type": "null"}, {"not": {"multipleOf": 2}}]}}
        },
    ],
    "TokenizeChatRequest": [
        {  # continue_final_message excludes add_generation_prompt (which defaults to true)
            "if": {
                "required": ["continue_final_message"],
                "properties": {"continue_final_message": {"const": True}},
            },
            "then": {
                "required": ["add_generation_prompt"],
                "properties": {"add_generation_prompt": {"const": False}},
            },
        }
    ],
}
# What no JSON Schema can say (the values of two fields compared, or the prompt's token count):
# a request breaking one gets a 400 naming the field. Given in each operation's description.
RULES = (
    "best_of, when given, must equal n",
    "min_tokens must be <= max_tokens (max_completion_tokens)",
    "the prompt's tokens must fit max_model_len, and with the requested max_tokens too "
    "(code context_length_exceeded)",
    "a structured output's JSON Schema, regex or grammar (response_format, structured_outputs) "
    "must compile (a 400 naming the field and the compiler's message)",
    "kv_eviction's budgets must add up (sink_tokens + recent_tokens <= budget_tokens; streaming "
    "without recent_tokens: budget_tokens > sink_tokens), and it needs n = 1",
)


def _runtime_bounds(doc: dict[str, Any], app: FastAPI) -> None:
    """What this server's model fixes: the served names (``model``), token ids below the
    vocabulary size, ``truncate_prompt_tokens`` up to ``max_model_len``."""
    state = getattr(app.state, "pagedkv", None)
    if state is None:
        return
    schemas = doc["components"]["schemas"]
    names = sorted(state.model_aliases)
    tok = state.async_llm.tokenizer
    vocab = None if tok is None else tok.vocab_size
    for name, schema in schemas.items():
        props = schema.get("properties", {})
        if name.endswith("Request") and "model" in props:
            props["model"] = {"anyOf": [{"type": "string", "enum": names}, {"type": "null"}]}
        if "truncate_prompt_tokens" in props:
            props["truncate_prompt_tokens"]["anyOf"][1]["maximum"] = (
                state.async_llm.engine.max_model_len
            )
        if vocab is None:
            continue
        arrays = [_id_arrays(props.get(k, {})) for k in ("prompt", "tokens", "stop_token_ids")]
        for ids in (a for found in arrays for a in found):
            ids["items"]["maximum"] = vocab - 1
    part = schemas.get("ChatContentPart")
    if part is not None and state.image_placeholder is None:
        # A text-only model: image parts are a 400, so the document offers text parts only.
        part.pop("oneOf", None)
        part["required"] = ["type", "text"]
        part["properties"].pop("image_url", None)
        part["properties"]["type"]["enum"] = ["text"]
    for name, rules in IF_THEN.items():
        schemas[name]["allOf"] = rules


def _id_arrays(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The arrays of token ids in a property's schema (nested ones included)."""
    if schema.get("type") == "array" and schema.get("items", {}).get("type") == "integer":
        return [schema]
    out = []
    for sub in schema.get("anyOf", []):
        out += _id_arrays(sub)
    if schema.get("type") == "array":
        out += _id_arrays(schema.get("items", {}))
    return out


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document for ``app`` with each route's body, responses and headers added."""
    from pagedkv import __version__

    with warnings.catch_warnings():  # the duplicate operation ids it warns of are replaced
        warnings.simplefilter("ignore", UserWarning)
        doc = get_openapi(title=app.title, version=__version__, routes=app.routes)
    _, defs = models_json_schema(_models(), ref_template=REF)
    # A copy: `_runtime_bounds` edits it, and the models' schema extras are shared constants.
    schemas = copy.deepcopy(defs.get("$defs", {}))
    doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
    _runtime_bounds(doc, app)
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            route = ROUTES.get((path, method))
            if route is None:
                continue
            if route.body:
                op["requestBody"] = _body(route)
            op["responses"] = _responses(route)
            op["parameters"] = [REQUEST_ID_PARAM]
            # Unique per operation (FastAPI names a GET+POST route's two alike).
            op["operationId"] = f"{method}_{path.strip('/').replace('/', '_') or 'root'}"
            op["summary"] = route.summary or op.get("summary", "")
            if route.stream:
                op["description"] = "Also checked (a 400 naming the field): " + "; ".join(RULES)
    return doc


def install(app: FastAPI) -> None:
    """Serve `build_openapi`'s document (built once, on the first request for it)."""
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "doc" not in cache:
            cache["doc"] = build_openapi(app)
        return cache["doc"]

    app.openapi = openapi  # type: ignore[method-assign]
