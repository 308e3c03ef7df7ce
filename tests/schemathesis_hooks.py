"""Schemathesis hooks for tests/test_server_schemathesis.py (``SCHEMATHESIS_HOOKS``).

The OpenAPI document states every constraint JSON Schema can state (ranges, lengths, enums, the
served model names, token ids below the vocabulary size, ``if``/``then`` for the boolean
dependencies). Four rules check values JSON Schema cannot check; they are listed in each
generation operation's description (`openapi.RULES`), answered with a 400 naming the field, and
this hook drops the generated bodies that break one, so that every remaining schema-valid body
must be accepted:

* ``best_of``, when given, must equal ``n``;
* ``min_tokens`` must be <= ``max_tokens`` (``max_completion_tokens``);
* the prompt's tokens (after ``truncate_prompt_tokens``) must fit ``max_model_len``, and with
  the requested ``max_tokens`` too;
* a structured output's JSON Schema, regex or grammar must compile (checked by compiling it,
  as the server does, with the same backends and tokenizer);
* ``kv_eviction``'s budgets must add up, and it needs ``n`` = 1 (checked by building the
  engine's `KVEvictionConfig` from a body that parses).

The token count uses the server's own tokenizer and chat template (the default model's GGUF).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import schemathesis

MAX_MODEL_LEN = int(os.environ.get("PKV_ST_MAX_MODEL_LEN", "512"))


@cache
def _tokenizer() -> Any:
    from pagedkv.models.loader import resolve_model_path
    from pagedkv.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(resolve_model_path(None))


def _prompt_lens(path: str, body: dict[str, Any]) -> list[int] | None:
    """Token counts of the body's prompts as the server computes them; None when the body does
    not parse (a negative case: the server must refuse it anyway)."""
    from pagedkv.entrypoints.openai import protocol as P

    tok = _tokenizer()
    try:
        if path == "/v1/completions":
            req = P.CompletionRequest.model_validate(body)
            return [len(tok.encode(p)) if isinstance(p, str) else len(p) for p in req.prompts()]
        req = P.ChatCompletionRequest.model_validate(body)
        text = tok.apply_chat_template(req.conversation(), req.add_generation_prompt)
        return [len(tok.encode(text, add_special_tokens=False))]
    except Exception:  # noqa: BLE001 - invalid body or template: nothing to filter on
        return None


@cache
def _structured_output_manager() -> Any:
    from pagedkv.engine.structured_output import StructuredOutputManager

    tok = _tokenizer()
    return StructuredOutputManager(tok, tok.vocab_size)


def _structured_output_compiles(path: str, body: dict[str, Any]) -> bool:
    """False when the body's response_format / structured_outputs is well-formed but does not
    compile (the fourth rule); True otherwise (a malformed one is the server's to refuse)."""
    from pagedkv.engine.sampling_params import SamplingParamError
    from pagedkv.entrypoints.openai import protocol as P

    model = P.CompletionRequest if path == "/v1/completions" else P.ChatCompletionRequest
    try:
        params = model.model_validate(body).structured_outputs_params()
    except Exception:  # noqa: BLE001 - malformed: the server must refuse it anyway
        return True
    if params is None:
        return True
    try:
        _structured_output_manager().compile(params)
    except SamplingParamError:
        return False
    return True


# The run's budget: a generated n up to 128 choices of up to max_model_len tokens each would
# take minutes per request on 2 cores. Bodies keep n (and an equal best_of) at most this; the
# schema's full range of n is the unit tests' (tests/test_server_errors.py).
MAX_N_IN_RUN = 2


@schemathesis.hook
def map_case(ctx: Any, case: Any) -> Any:
    body = case.body
    n = body.get("n") if isinstance(body, dict) else None
    if isinstance(n, int) and MAX_N_IN_RUN < n <= 128:  # a valid n (an invalid one stays)
        if body.get("best_of") == body["n"]:
            body["best_of"] = MAX_N_IN_RUN
        body["n"] = MAX_N_IN_RUN
    return case


def _kv_eviction_adds_up(body: dict[str, Any]) -> bool:
    """False for a well-typed ``kv_eviction`` whose budgets do not add up, or with n > 1 (the
    rule); a body that does not parse stays (the server must refuse it anyway)."""
    from pagedkv.core.token_eviction import KVEvictionConfig
    from pagedkv.entrypoints.openai import protocol as P

    ev = body.get("kv_eviction")
    if not isinstance(ev, dict):
        return True
    try:
        parsed = P.KVEviction.model_validate(ev)
    except Exception:  # noqa: BLE001 - a negative case
        return True
    if body.get("n") not in (None, 1):
        return False
    try:
        KVEvictionConfig.from_value(parsed.to_dict())
    except ValueError:
        return False
    return True


@schemathesis.hook
def filter_case(ctx: Any, case: Any) -> bool:
    """False for a body that breaks one of the rules above (`filter_case` runs in every phase,
    before `map_case`)."""
    return _keeps_the_rules(case.operation.path, case.body)


def _keeps_the_rules(path: str, body: Any) -> bool:
    if path not in ("/v1/completions", "/v1/chat/completions") or not isinstance(body, dict):
        return True
    n = body.get("n", 1)
    if path == "/v1/completions" and body.get("best_of") not in (None, n):
        return False
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if path == "/v1/completions" and "max_tokens" not in body:
        max_tokens = 16  # OpenAI's default for completions
    min_tokens = body.get("min_tokens") or 0
    if isinstance(max_tokens, (int, float)) and isinstance(min_tokens, (int, float)):
        if min_tokens > max_tokens:
            return False
    if not _structured_output_compiles(path, body):
        return False
    if not _kv_eviction_adds_up(body):
        return False
    lens = _prompt_lens(path, body)
    if lens is None:
        return True
    keep = body.get("truncate_prompt_tokens")
    if isinstance(keep, (int, float)) and keep:
        k = MAX_MODEL_LEN if keep == -1 else int(keep)
        lens = [min(n_, k) for n_ in lens]
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    for n_ in lens:
        if n_ > MAX_MODEL_LEN:
            return False
        if isinstance(asked, (int, float)) and n_ + asked > MAX_MODEL_LEN:
            return False
    return True
