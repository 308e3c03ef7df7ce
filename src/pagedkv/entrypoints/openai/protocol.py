"""Request and response models of the OpenAI-compatible server (pydantic).

Requests are validated strictly (``strict=True``: a string is not an integer, ``1.5`` is not an
``n``); unknown fields are ignored, as OpenAI's and vLLM's servers do. Besides OpenAI's
parameters, vLLM's sampling extensions are accepted: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, and vLLM's ``kv_transfer_params`` (an
object handed to the KV connector as ``SamplingParams.kv_transfer_params``; responses carry the
connector's params for the finished request at their top level, null when there are none).

Value checks (ranges) are left to `SamplingParams`, which names the offending parameter; the
server turns its ValueError into a 400 whose ``param`` is the request field. Numbers must be
finite (``allow_inf_nan=False``: ``1e999`` is refused like ``NaN``), so a NaN temperature never
reaches the sampler.

Structured outputs: OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``,
``disable_any_whitespace``) become `StructuredOutputsParams`; a grammar that does not compile is
a 400 naming the field it came from.

Fields of OpenAI's or vLLM's API that pagedkv does not implement (tools, function calling,
``logit_bias``, vLLM's removed ``guided_*``) are refused with a 400 naming the field rather than
ignored: a client relying on them must not get a 200 that silently did something else.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from pagedkv.core.token_eviction import FIELDS as KV_EVICTION_FIELDS
from pagedkv.engine.sampling_params import (
    SamplingParamError,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedkv.kv_transfer.config import KV_TRANSFER_PARAM_KEYS

MAX_LOGPROBS = 20
MAX_N = 128  # choices per request (OpenAI's documented limit): bounds the work one request asks
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Constrained types: the ranges `SamplingParams` checks, stated in the schema too (/openapi.json),
# so a client (or a schema fuzzer) knows what is accepted before sending it.


def _integral(v: Any) -> Any:
    """``3.0`` is an integer in JSON (and JSON Schema): accept it where an int is expected;
    ``1.5``, ``"3"`` and ``true`` stay refused (the models are strict)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


# The bounds go before the validator: pydantic then states them in the schema as JSON Schema's.
Int = Annotated[int, BeforeValidator(_integral)]
TokenId = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_integral)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1), BeforeValidator(_integral)]
# Union fields keep plain types for validation (`check` gives the clearer message, e.g. "prompt
# must not be empty"); the schema states their constraints (`json_schema_extra` replaces anyOf).
_STR1 = {"type": "string", "minLength": 1}
_IDS1 = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = [
    _STR1,
    {"type": "array", "items": _STR1, "minItems": 1},
    _IDS1,
    {"type": "array", "items": _IDS1, "minItems": 1},
]
STOP_SCHEMA = [_STR1, {"type": "array", "items": _STR1}, {"type": "null"}]


def _schema(any_of: list[dict[str, Any]]) -> dict[str, Any]:
    return {"anyOf": any_of}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- shared ----------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


# Fields that pagedkv does not implement, with the values that mean "not used" (accepted).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}


class JsonSchemaFormat(_Request):
    """``response_format.json_schema`` (OpenAI's shape; ``strict`` is accepted: outputs always
    follow the schema)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``text`` (unconstrained), ``json_object`` (any JSON
    object) or ``json_schema`` (``json_schema.schema`` required)."""

    model_config = ConfigDict(
        strict=True,
        extra="ignore",
        # json_schema (with its schema) is required by type json_schema, stated for clients.
        json_schema_extra={
            "if": {"properties": {"type": {"const": "json_schema"}}},
            "then": {
                "required": ["json_schema"],
                "properties": {
                    "json_schema": {
                        "type": "object",
                        "required": ["schema"],
                        "properties": {"schema": {"type": "object"}},
                    }
                },
            },
        },
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` request field: exactly one of ``json`` (a JSON Schema),
    ``regex``, ``choice``, ``grammar`` (GBNF/EBNF or Lark) and ``json_object``. Another key
    (vLLM's ``structural_tag``, ``whitespace_pattern``...) is a 400 naming it."""

    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        allow_inf_nan=False,
        populate_by_name=True,
        # Exactly one constraint (null, and json_object false, mean unset), stated for clients.
        json_schema_extra={
            "oneOf": [
                {"required": ["json"], "properties": {"json": {"type": ["object", "string"]}}},
                {"required": ["regex"], "properties": {"regex": {"type": "string"}}},
                {"required": ["choice"], "properties": {"choice": {"type": "array"}}},
                {"required": ["grammar"], "properties": {"grammar": {"type": "string"}}},
                {"required": ["json_object"], "properties": {"json_object": {"const": True}}},
            ]
        },
    )

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, json_schema_extra={"minLength": 1})
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, json_schema_extra={"minLength": 1})
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class KVTransferParams(_Request):
    """vLLM's per-request ``kv_transfer_params``, typed: the offloading connector's keys and
    prefill/decode disaggregation's (what a producer's response carries for its consumer).
    Another key, or a value of the wrong type, is a 400 naming it; unset ones are not passed."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    max_offload_tokens: Annotated[int, Field(ge=0), BeforeValidator(_integral)] | None = None
    offload_policy: Literal["BLOCK_LEVEL", "REQUEST_LEVEL"] | None = None
    skip_reading_prefix_cache: bool | None = None
    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    remote_engine_id: str | None = None
    remote_block_ids: list[TokenId] | list[list[TokenId]] | None = None
    remote_host: str | None = None
    remote_port: Annotated[int, Field(ge=0, le=65535), BeforeValidator(_integral)] | None = None
    remote_request_id: str | None = None
    remote_num_tokens: Annotated[int, Field(ge=0), BeforeValidator(_integral)] | None = None
    remote_blocks_expiry_time: float | None = None
    transfer_mode: Literal["pull", "push"] | None = None
    tp_size: PositiveInt | None = None
    dcp_size: PositiveInt | None = None
    pp_size: PositiveInt | None = None
    remote_registration_generation: Int | None = None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


assert set(KVTransferParams.model_fields) == KV_TRANSFER_PARAM_KEYS  # one list of keys


class KVEviction(_Request):
    """pagedkv's per-request token eviction (``SamplingParams.kv_eviction``,
    `core.token_eviction`): a lossy KV policy. Another key, or a value of the wrong type, is a
    400 naming it; combinations are checked by the engine (also a 400)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    policy: Literal["streaming", "snapkv", "pyramidkv"]
    sink_tokens: Annotated[int, Field(ge=0), BeforeValidator(_integral)] | None = None
    recent_tokens: PositiveInt | None = None
    budget_tokens: PositiveInt | None = None
    compress_at: PositiveInt | None = None
    pool_kernel: Annotated[int, Field(ge=1, le=255), BeforeValidator(_integral)] | None = None
    positions: Literal["original", "cache"] | None = None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


assert set(KVEviction.model_fields) == set(KV_EVICTION_FIELDS)  # one list of keys


def _unused(name: str) -> dict[str, Any]:
    """The schema of an unimplemented field: only its values that mean "not used"."""
    return {"enum": list(UNSUPPORTED_FIELDS[name])}


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions. Unknown fields are kept in
    ``model_extra`` (``extra="allow"``) only so that `check` can refuse ``guided_*``."""

    model_config = ConfigDict(
        strict=True,
        extra="allow",
        allow_inf_nan=False,
        # vLLM's guided_* fields (guided decoding) are refused unless null.
        json_schema_extra={"patternProperties": {"^guided_": {"type": "null"}}},
    )

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_integral)] = 1
    temperature: Annotated[float, Field(ge=0)] | None = None  # None: 1.0 (OpenAI's default)
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: str | list[str] | None = Field(None, json_schema_extra=_schema(STOP_SCHEMA))
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # Refused when not empty (`check`): the schema says so.
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0})
    user: str | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1), BeforeValidator(_integral)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    min_tokens: Annotated[int, Field(ge=0), BeforeValidator(_integral)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM: requests share cached blocks only with the same salt
    cache_salt: str | None = Field(None, json_schema_extra={"minLength": 1})
    # vLLM: per-request KV connector params (PD disaggregation, offload policy); SamplingParams
    # checks the keys, so an unknown one is a 400 naming this field.
    kv_transfer_params: KVTransferParams | None = None
    # pagedkv: this request's token eviction (lossy KV; docs/features/lossy-kv.md).
    kv_eviction: KVEviction | None = None
    # vLLM: each choice carries its ``token_ids`` (per chunk when streaming: the new ones) and
    # the prompt's ``prompt_token_ids`` (completions: on the choice, in its first chunk; chat: on
    # the response / the chunk that first carries tokens). `pagedkv proxy` resumes a broken
    # stream from them.
    return_token_ids: bool = False
    # vLLM: keep only the last k prompt tokens (left truncation); -1: the model's context.
    truncate_prompt_tokens: (
        Annotated[Literal[-1] | PositiveInt, BeforeValidator(_integral)] | None
    ) = None
    # Not implemented: refused unless unused (see UNSUPPORTED_FIELDS; the schema lists the
    # values accepted).
    tools: Any = Field(None, json_schema_extra=_unused("tools"))
    tool_choice: Any = Field(None, json_schema_extra=_unused("tool_choice"))
    functions: Any = Field(None, json_schema_extra=_unused("functions"))
    function_call: Any = Field(None, json_schema_extra=_unused("function_call"))
    # Structured outputs (`structured_outputs_params`): at most one of the two.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    def check(self) -> None:
        """Cross-field checks pydantic does not do; RequestError ``(param, message)``."""
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                "stream_options", "stream_options is only allowed when stream is true"
            )
        if self.logit_bias:
            raise RequestError("logit_bias", "logit_bias is not supported")
        if self.cache_salt is not None and not self.cache_salt:
            raise RequestError("cache_salt", "cache_salt must be a non-empty string")
        t = self.truncate_prompt_tokens
        if t is not None and (t == 0 or t < -1):
            raise RequestError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be -1 (the model's context) or >= 1, got {t}",
            )
        self._check_unsupported()
        self.structured_outputs_params()  # its RequestError, before anything is queued

    def structured_outputs_field(self) -> str:
        """The request field a structured output comes from (what its 400 names)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """``response_format`` or ``structured_outputs`` as the engine's params; None for
        neither (or ``{"type": "text"}``). RequestError naming the field when invalid."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type == "text":
            rf = None
        if rf is not None and so is not None:
            raise RequestError(
                "structured_outputs", "set response_format or structured_outputs, not both"
            )
        try:
            if so is not None:
                return StructuredOutputsParams(
                    json=so.json_,
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                    json_object=so.json_object,
                    disable_any_whitespace=so.disable_any_whitespace,
                )
            if rf is None:
                return None
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise RequestError(
                    "response_format",
                    "response_format of type json_schema needs json_schema.schema",
                )
            return StructuredOutputsParams(json=rf.json_schema.schema_)
        except SamplingParamError as e:
            raise RequestError(self.structured_outputs_field(), str(e)) from None

    def _check_unsupported(self) -> None:
        """Refuse fields that pagedkv does not implement, unless their value means "unused"."""
        for name, unused in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            if not any(value == u and type(value) is type(u) for u in unused):
                raise RequestError(
                    name, f"{name} is not supported by this server (got {_brief(value)})"
                )
        for name, value in (self.model_extra or {}).items():
            if name.startswith("guided_") and value is not None:
                raise RequestError(
                    name,
                    f"{name} is not supported (vLLM removed the guided_* fields): use "
                    f"structured_outputs={{{name.removeprefix('guided_')!r}: ...}} instead",
                )

    def _sampling_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=self.stop,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            kv_transfer_params=None
            if self.kv_transfer_params is None
            else self.kv_transfer_params.to_dict(),
            kv_eviction=None if self.kv_eviction is None else self.kv_eviction.to_dict(),
            structured_outputs=self.structured_outputs_params(),
        )
        return kw


def _brief(value: Any) -> str:
    """``value`` as short JSON for an error message."""
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class RequestError(ValueError):
    """Invalid request: ``param`` names the field (OpenAI's error ``param``)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def make_sampling_params(
    kwargs: dict[str, Any], rename: dict[str, str] | None = None
) -> SamplingParams:
    """`SamplingParams(**kwargs)`; its ValueError becomes a RequestError naming the request
    field (``rename`` maps SamplingParams names to request names)."""
    try:
        return SamplingParams(**kwargs)
    except SamplingParamError as e:
        msg, param = str(e), e.param
        if rename and param in rename:
            head = len(e.PREFIX) + len(param)
            param = rename[param]
            msg = e.PREFIX + param + msg[head:]
        raise RequestError(param, msg) from None
    except ValueError as e:
        raise RequestError(None, str(e)) from None


# ---- completions -----------------------------------------------------------------------------


class CompletionRequest(_SamplingRequest):
    # Emptiness is refused by `check` (a clear message); the schema states it.
    prompt: str | list[str] | list[Int] | list[list[Int]] = Field(
        json_schema_extra=_schema(PROMPT_SCHEMA)
    )
    max_tokens: PositiveInt | None = 16
    logprobs: LogprobCount | None = None
    # vLLM extension: each choice's ``prompt_logprobs`` (None, then per prompt token
    # {token id: {logprob, rank, decoded_token}}: the prompt token and the top k).
    prompt_logprobs: LogprobCount | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_integral)] | None = None
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})  # refused unless empty

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, list) and not self.prompt:
            raise RequestError("prompt", "prompt must not be empty")
        if isinstance(self.prompt, list) and not all(isinstance(p, int) for p in self.prompt):
            for i, p in enumerate(self.prompt):
                if not p:
                    raise RequestError(f"prompt[{i}]", f"prompt[{i}] must not be empty")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of", "best_of is not supported (it must equal n)")
        if self.suffix:
            raise RequestError("suffix", "suffix is not supported")
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise RequestError("logprobs", f"logprobs must be <= {MAX_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise RequestError("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        kw = self._sampling_kwargs()
        kw.update(
            max_tokens=self.max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.effective_prompt_logprobs(),
        )
        return make_sampling_params(kw)

    def effective_prompt_logprobs(self) -> int | None:
        """The engine's ``prompt_logprobs``: the field, or with ``echo`` and ``logprobs: k`` at
        least ``k`` (vLLM: echoed prompt tokens get their logprobs first in ``logprobs``)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def requested_max_tokens(self) -> tuple[str, int] | None:
        """``(field, value)`` of a completion length the client asked for, else None. OpenAI's
        implicit default (16) is not a request: it is clamped to what the context leaves."""
        if "max_tokens" in self.model_fields_set and self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return None


class CompletionLogProbs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(_Response):
    """vLLM's serialized `Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    # With ``prompt_logprobs`` (vLLM): None for the first prompt token, then token id -> logprob.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    # The KV connector's params of the finished request (vLLM's field; null without one).
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamResponse(_Response):
    """One SSE chunk; the last one also carries ``kv_transfer_params`` (an extra field, set by
    serving_engine), so that the other chunks do not repeat a null."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- chat completions ----------------------------------------------------------------------


class ChatImageURL(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    url: str
    detail: str | None = None


class ChatContentPart(BaseModel):
    """A content part: ``text``, or ``image_url`` (a ``data:image/...;base64,`` URL, or a local
    file under the server's ``--allowed-local-media-path``; nothing is fetched). An image for a
    model without image inputs, or another part type, is a 400 naming the part."""

    model_config = ConfigDict(
        strict=True,
        extra="allow",
        json_schema_extra={
            "required": ["type"],
            "oneOf": [
                {"required": ["type", "text"], "properties": {"type": {"const": "text"}}},
                {
                    "required": ["type", "image_url"],
                    "properties": {"type": {"const": "image_url"}},
                },
            ],
        },
    )
    type: str = Field(json_schema_extra={"enum": ["text", "image_url"]})
    text: str | None = Field(None, json_schema_extra={"type": "string"})
    image_url: ChatImageURL | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})  # `check_messages` names it
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    def text(
        self, index: int, image_placeholder: str | None = None, images: list[str] | None = None
    ) -> str:
        """The content as template text: an image part becomes ``image_placeholder`` (the
        model's image token) and its URL is appended to ``images``. RequestError naming the
        part for another type, or an image when ``image_placeholder`` is None."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            where = f"messages[{index}].content[{j}]"
            if part.type == "image_url" and part.image_url is not None:
                if image_placeholder is None or images is None:
                    raise RequestError(where, "this model takes text only, not image inputs")
                images.append(part.image_url.url)
                parts.append(image_placeholder)
                continue
            if part.type != "text" or part.text is None:
                raise RequestError(
                    where,
                    f"only text and image_url content parts are supported, got type {part.type!r}",
                )
            parts.append(part.text)
        return "\n".join(parts)


def check_messages(messages: list[ChatMessage]) -> None:
    """RequestError unless there are messages, each with a known role."""
    if not messages:
        raise RequestError("messages", "messages must not be empty")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise RequestError(
                f"messages[{i}].role",
                f"unknown role {m.role!r}: use one of {', '.join(CHAT_ROLES)}",
            )


def conversation(
    messages: list[ChatMessage],
    image_placeholder: str | None = None,
    images: list[str] | None = None,
) -> list[dict[str, str]]:
    """The messages as the chat template takes them (``developer`` is ``system``); image parts
    become ``image_placeholder`` with their URLs appended to ``images`` (see `ChatMessage.text`)."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": m.text(i, image_placeholder, images)})
    return out


class ECTransferParams(_Request):
    """Where an encoder instance keeps this request's images' encoder outputs (EPD;
    `engine.ec_transfer`): what its ``/v1/encode`` answered. An image it does not list, or
    one that cannot be read, is encoded here."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    ec_host: str
    ec_port: Annotated[int, Field(ge=1, le=65535), BeforeValidator(_integral)]
    items: list[str] = Field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


class EncodeResponse(_Response):
    """``/v1/encode``: the ``ec_transfer_params`` to send with the request to a prefill (or
    colocated) instance, and the images and encoder tokens computed."""

    ec_transfer_params: dict[str, Any]
    num_images: int
    encoder_tokens: int


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    # EPD: where an encoder instance keeps the images' encoder outputs (`/v1/encode`'s answer).
    ec_transfer_params: ECTransferParams | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    add_generation_prompt: bool = True  # vLLM extension

    def check(self) -> None:
        super().check()
        check_messages(self.messages)
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise RequestError("top_logprobs", "top_logprobs needs logprobs to be true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise RequestError("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}]")

    def conversation(
        self, image_placeholder: str | None = None, images: list[str] | None = None
    ) -> list[dict[str, str]]:
        return conversation(self.messages, image_placeholder, images)

    def to_sampling_params(self) -> SamplingParams:
        kw = self._sampling_kwargs()
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        kw.update(
            max_tokens=max_tokens, logprobs=(self.top_logprobs or 0) if self.logprobs else None
        )
        rename = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"
        return make_sampling_params(kw, rename)

    def requested_max_tokens(self) -> tuple[str, int] | None:
        """``(field, value)`` of the completion length asked for (``max_completion_tokens``
        wins over the deprecated ``max_tokens``), else None."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        if self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(_Response):
    content: list[ChatLogprobContent] | None = None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None
    # The KV connector's params of the finished request (vLLM's field; null without one).
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- models, errors --------------------------------------------------------------------------


# ---- tokenization (vLLM's /tokenize, /detokenize, /tokenizer_info) -------------------------


class TokenizeCompletionRequest(_Request):
    """Text to ids (vLLM's shape). lm-eval's remote tokenizer sends ``add_special_tokens: false``."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    """Messages rendered with the chat template (or ``chat_template``), then to ids."""

    model: str | None = None
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        check_messages(self.messages)
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError(
                "continue_final_message",
                "cannot set both continue_final_message and add_generation_prompt to true",
            )

    def conversation(
        self, image_placeholder: str | None = None, images: list[str] | None = None
    ) -> list[dict[str, str]]:
        return conversation(self.messages, image_placeholder, images)


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfoResponse(_Response):
    """The tokenizer's configuration, as ``tokenizer_config.json`` would give it (vLLM's shape):
    lm-eval's remote tokenizer reads ``eos_token``, ``bos_token``, ``pad_token`` and
    ``chat_template``."""

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    model_max_length: int
    vocab_size: int


class VersionResponse(_Response):
    version: str


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedkv"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
