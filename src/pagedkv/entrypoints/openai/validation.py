"""Request validation: a body becomes a request model, or a 400 naming the field at fault.

`parse_body` refuses what is not JSON (``NaN``/``Infinity`` literals included), wrong types and
invalid values with one clear sentence and OpenAI's ``param``; `check_context_length` refuses
prompts or requested completion lengths that do not fit the context, in vLLM's words.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pagedkv.entrypoints.openai import protocol as P
from pagedkv.entrypoints.openai.errors import bad_request

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """The request body as ``model``, cross-field checks (``model.check()``) included; an
    `APIError` 400 naming the field otherwise."""
    body = await request.body()
    check_non_finite_literals(body)
    try:
        parsed = model.model_validate_json(body or b"null")
    except ValidationError as e:
        msg, param = validation_message(e, model)
        raise bad_request(msg, param) from None
    check = getattr(parsed, "check", None)
    if check is not None:
        try:
            check()
        except P.RequestError as e:
            raise bad_request(e.message, e.param) from None
    return parsed


def check_context_length(
    max_model_len: int, prompt_lens: list[int], requested: tuple[str, int] | None, where: str
) -> None:
    """vLLM's context-length check: a prompt longer than ``max_model_len``, or a requested
    completion length (``requested = (field, tokens)``) that does not fit after the prompt, is
    a 400 (``code: context_length_exceeded``) in vLLM's words; ``where`` is "prompt" or
    "messages". A length the client did not ask for is clamped by the engine instead."""
    for n in prompt_lens:
        head = (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested"
        )
        if n > max_model_len:
            raise bad_request(
                f"{head} {n} tokens in the {where}. Please reduce the length of the {where}.",
                where,
                "context_length_exceeded",
            )
        if requested is not None and n + requested[1] > max_model_len:
            field_, c = requested
            raise bad_request(
                f"{head} {n + c} tokens ({n} in the {where}, {c} in the completion). "
                f"Please reduce the length of the {where} or completion.",
                field_,
                "context_length_exceeded",
            )


def truncate_prompts(
    token_ids: list[list[int]], keep: int | None, max_model_len: int
) -> list[list[int]]:
    """vLLM's ``truncate_prompt_tokens``: each prompt's last ``keep`` tokens (-1: the model's
    context; None: unchanged). More than ``max_model_len`` is a 400 naming the field."""
    if keep is None:
        return token_ids
    if keep > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
            f"({max_model_len}). Please select a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    k = max_model_len if keep == -1 else keep
    return [ids[-k:] for ids in token_ids]


# ---- pydantic errors -----------------------------------------------------------------------------


def validation_message(err: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """One clear sentence (and the ``param``) from a pydantic error."""
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return (
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
            None,
        )
    loc = first["loc"]
    if not loc:
        return "the request body must be a JSON object", None
    param = _param_path(loc)
    if first["type"] == "missing":
        return f"missing required field '{param}'", param
    top = str(loc[0])
    same_field = [e for e in errors if e["loc"][:1] == (top,)]
    field = model.model_fields.get(top)
    if (
        len(same_field) > 1
        and field is not None
        and _is_union(field.annotation)
        and len(loc) > 1
        and isinstance(loc[1], str)
    ):
        # A union: every member failed. Say what was expected instead of listing each member.
        return (
            f"invalid type for '{top}': expected {_type_name(field.annotation)}, "
            f"got {_json_type(same_field[0].get('input'))}"
        ), top
    why = _bound_message(first) or first["msg"]
    return f"invalid value for '{param}': {why} (got {_short(first.get('input'))})", param


# pydantic's range and length errors, said as the API reference says them.
_BOUNDS = {
    "greater_than_equal": ("ge", ">="),
    "greater_than": ("gt", ">"),
    "less_than_equal": ("le", "<="),
    "less_than": ("lt", "<"),
}


def _bound_message(error: Any) -> str | None:
    ctx = error.get("ctx") or {}
    if error["type"] in _BOUNDS:
        key, op = _BOUNDS[error["type"]]
        return f"must be {op} {ctx.get(key)}"
    if error["type"] in ("too_short", "string_too_short"):
        n = ctx.get("min_length")
        return f"must have at least {n} {'character' if 'string' in error['type'] else 'item'}" + (
            "s" if n != 1 else ""
        )
    return None


def _param_path(loc: tuple[int | str, ...]) -> str:
    """``messages[0].content`` from a pydantic location, union-member tags (``str``,
    ``list[int]``) dropped."""
    path = [str(loc[0])]
    for part in loc[1:]:
        if isinstance(part, int):
            path[-1] += f"[{part}]"
        elif not any(c in str(part) for c in "[]|") and part not in ("str", "int", "float", "bool"):
            path.append(str(part))
    return ".".join(path)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _type_name(annotation: Any) -> str:
    """``str | list[int] | None`` for an annotation (constraints and module paths dropped)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(map(_type_name, args))}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _json_type(x: Any) -> str:
    for t, name in (
        (bool, "boolean"),
        (int, "integer"),
        (float, "number"),
        (str, "string"),
        (list, "array"),
        (dict, "object"),
        (type(None), "null"),
    ):
        if isinstance(x, t):
            return name
    return type(x).__name__


def _short(x: Any) -> str:
    try:
        s = json.dumps(x)
    except (TypeError, ValueError):
        s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


# ---- NaN / Infinity ------------------------------------------------------------------------------


class _NonFinite:
    """Stands for a ``NaN``/``Infinity``/``-Infinity`` literal while locating it."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _non_finite_path(obj: Any, path: str = "") -> tuple[str, str] | None:
    """``(field path, literal)`` of the first `_NonFinite` in a parsed body, else None."""
    if isinstance(obj, _NonFinite):
        return path, obj.literal
    items: Any = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
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
    raise bad_request(
        f"invalid value for '{path}': {literal} is not a valid number "
        "(invalid JSON: NaN/Infinity are not valid numbers)",
        path,
    )
