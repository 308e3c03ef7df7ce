"""``POST /v1/completions``: prompts (a string, token ids, or a list of either) to choices.

Choice ``index = prompt_index * n + sample_index``; ``echo`` prefixes each choice with its
prompt; ``logprobs: k`` gives the sampled token's logprob and the top ``k`` per token.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedkv.engine.outputs import CompletionOutput
from pagedkv.entrypoints import protocol as P
from pagedkv.entrypoints.errors import bad_request
from pagedkv.entrypoints.serving_engine import (
    ChoiceRenderer,
    ServerState,
    add_all,
    generate_response,
    server_state,
    tokenize,
)
from pagedkv.entrypoints.validation import check_context_length, parse_body


async def create_completion(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, P.CompletionRequest)
    state.check_model(req.model)
    try:
        params = req.to_sampling_params()
    except P.RequestError as e:
        raise bad_request(e.message, e.param) from None
    prompts = req.prompts()
    token_ids = await tokenize(state, prompts)
    check_context_length(state.async_llm.engine.max_model_len, [len(t) for t in token_ids],
                         req.requested_max_tokens(), "prompt")
    engine_prompts = [{"prompt_token_ids": ids, "prompt": p} if isinstance(p, str) else {"prompt_token_ids": ids}
                      for p, ids in zip(prompts, token_ids)]
    renderer = CompletionRenderer(
        state, request_id=f"cmpl-{uuid.uuid4().hex}", model=req.model or state.served_model_name,
        created=int(time.time()), n=params.n, top_k=req.logprobs,
        echo_text=[p if isinstance(p, str) else state.async_llm.tokenizer.decode(p) for p in prompts]
        if req.echo else None)
    streams = await add_all(state, renderer.request_id, engine_prompts, params, "prompt", req.cache_salt)
    return await generate_response(request, renderer, streams, params, req.stream, req.stream_options,
                                   req.return_token_ids)


@dataclass
class CompletionRenderer(ChoiceRenderer):
    """Completions' choices and responses (see `ChoiceRenderer`)."""

    state: ServerState
    request_id: str
    model: str
    created: int
    n: int
    top_k: int | None  # the request's ``logprobs``; None: no logprobs
    echo_text: list[str] | None  # per prompt, with ``echo``
    prompt_param: str = "prompt"

    def echo(self, pi: int) -> str:
        return self.echo_text[pi] if self.echo_text is not None else ""

    def stream_choice(self, pi: int, c: CompletionOutput, text: str, t0: int, t1: int,
                      text_offset: int, finished: bool) -> P.CompletionResponseChoice:
        return P.CompletionResponseChoice(
            index=pi * self.n + c.index, text=text, logprobs=self._logprobs(c, t0, t1, text_offset),
            finish_reason=c.finish_reason if finished else None,
            stop_reason=c.stop_reason if finished else None)

    def stream_chunk(self, choices: list, usage: P.UsageInfo | None = None) -> P.CompletionStreamResponse:
        return P.CompletionStreamResponse(id=self.request_id, created=self.created, model=self.model,
                                          choices=choices, usage=usage)

    def final_choice(self, pi: int, c: CompletionOutput, text: str) -> P.CompletionResponseChoice:
        return P.CompletionResponseChoice(index=pi * self.n + c.index, text=text,
                                          logprobs=self._logprobs(c, 0, len(c.token_ids), 0),
                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def response(self, choices: list, usage: P.UsageInfo,
                 kv_transfer_params: dict[str, Any] | None = None) -> P.CompletionResponse:
        return P.CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                    choices=choices, usage=usage, kv_transfer_params=kv_transfer_params)

    def _logprobs(self, c: CompletionOutput, t0: int, t1: int, offset0: int) -> P.CompletionLogProbs | None:
        """Tokens ``t0:t1`` of ``c`` in completions' logprobs shape; ``offset0``: the text
        offset of token ``t0``."""
        k = self.top_k
        if k is None:
            return None
        lp = P.CompletionLogProbs()
        offset = offset0
        for i in range(t0, t1):
            tid = c.token_ids[i]
            d = c.logprobs[i] if c.logprobs is not None and i < len(c.logprobs) else {}
            text = self.state.token_text(tid)
            chosen = d.get(tid)
            lp.tokens.append(text)
            lp.token_logprobs.append(chosen.logprob if chosen is not None else None)
            top = sorted((x for x in d.items() if x[1].rank <= max(k, 1)), key=lambda x: x[1].rank)[:k]
            lp.top_logprobs.append({self.state.token_text(t): v.logprob for t, v in top} if k > 0 else None)
            lp.text_offset.append(offset)
            offset += len(text)
        return lp
