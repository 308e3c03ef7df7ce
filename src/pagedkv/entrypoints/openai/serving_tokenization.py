"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``: vLLM's shapes.

A client that counts tokens, or evaluates through the server with the server's own tokenizer
(lm-eval's remote tokenizer checks ``/tokenizer_info`` for ``eos_token``, then calls
``/tokenize`` with ``add_special_tokens: false`` and ``/detokenize``), gets exactly the ids the
engine would run. ``/tokenize`` takes either a ``prompt`` or chat ``messages`` (rendered with
the model's template, or the request's ``chat_template``), tokenized on a worker thread.

``/tokenizer_info`` is opt-in (``--enable-tokenizer-info-endpoint``, as in vLLM): it discloses
the chat template and special tokens.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedkv.entrypoints.openai import protocol as P
from pagedkv.entrypoints.openai.errors import APIError, bad_request
from pagedkv.entrypoints.openai.serving_engine import ServerState, server_state
from pagedkv.entrypoints.openai.validation import parse_body


def _tokenizer(state: ServerState, param: str | None) -> Any:
    tok = state.async_llm.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer", param)
    return tok


async def tokenize(request: Request) -> Response:
    """``{"count", "max_model_len", "tokens", "token_strs"}`` for a ``prompt`` or ``messages``.
    A prompt longer than the context is still tokenized (the count says so)."""
    state = server_state(request)
    try:
        chat = isinstance(body := json.loads(await request.body() or b"null"), dict) and (
            "messages" in body
        )
    except ValueError:
        chat = False  # parse_body names the JSON error
    model = P.TokenizeChatRequest if chat else P.TokenizeCompletionRequest
    req = await parse_body(request, model)
    state.check_model(req.model)
    param = "messages" if chat else "prompt"
    tok = _tokenizer(state, param)

    def run() -> list[int]:
        if isinstance(req, P.TokenizeChatRequest):
            text = tok.apply_chat_template(
                req.conversation(state.image_placeholder, []),  # an image: its one token
                add_generation_prompt=req.add_generation_prompt,
                chat_template=req.chat_template,
                continue_final_message=req.continue_final_message,
                **(req.chat_template_kwargs or {}),
            )
        else:
            text = req.prompt
        return tok.encode(text, add_special_tokens=req.add_special_tokens)

    try:
        ids = await asyncio.to_thread(run)
    except Exception as e:  # a template that fails to render (a bad chat_template)
        raise bad_request(f"cannot apply the chat template: {e}", param) from None
    strs = [tok.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    out = P.TokenizeResponse(
        count=len(ids),
        max_model_len=state.async_llm.engine.max_model_len,
        tokens=ids,
        token_strs=strs,
    )
    return JSONResponse(out.model_dump())


async def detokenize(request: Request) -> Response:
    """``{"prompt"}``: the text of ``tokens`` (special tokens kept, as vLLM's endpoint does);
    an id outside the vocabulary is a 400 naming ``tokens[i]``."""
    state = server_state(request)
    req = await parse_body(request, P.DetokenizeRequest)
    state.check_model(req.model)
    tok = _tokenizer(state, "tokens")
    vocab = tok.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise bad_request(
                f"token id {t} is out of range: the vocabulary has {vocab} tokens", f"tokens[{i}]"
            )
    text = await asyncio.to_thread(tok.decode, req.tokens, False)
    return JSONResponse(P.DetokenizeResponse(prompt=text).model_dump())


async def tokenizer_info(request: Request) -> Response:
    """The tokenizer's configuration (see `P.TokenizerInfoResponse`); 404 unless enabled."""
    state = server_state(request)
    if not state.enable_tokenizer_info:
        raise APIError(
            404,
            "the tokenizer info endpoint is disabled: start the server with "
            "--enable-tokenizer-info-endpoint",
            "not_found_error",
            None,
            "endpoint_disabled",
        )
    tok = _tokenizer(state, None)

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tok.id_to_token(token_id)

    out = P.TokenizerInfoResponse(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=text(tok.bos_token_id),
        eos_token=text(tok.eos_token_id),
        pad_token=text(tok.pad_token_id),
        chat_template=tok.chat_template,
        model_max_length=state.async_llm.engine.max_model_len,
        vocab_size=tok.vocab_size,
    )
    return JSONResponse(out.model_dump())
