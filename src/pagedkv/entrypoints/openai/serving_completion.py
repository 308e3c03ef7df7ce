"""``POST /v1/completions``: prompts (a string, token ids, or a list of either) to choices.

Choice ``index = prompt_index * n + sample_index``; ``echo`` prefixes each choice with its
prompt; ``logprobs: k`` gives the sampled token's logprob and the top ``k`` per token, and with
``echo`` the prompt tokens' first (the first one null: OpenAI's and vLLM's shape). vLLM's
``prompt_logprobs: k`` puts each choice's ``prompt_logprobs`` (also set by echo + logprobs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedkv.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedkv.entrypoints.openai import protocol as P
from pagedkv.entrypoints.openai.errors import bad_request
from pagedkv.entrypoints.openai.serving_engine import (
    ChoiceRenderer,
    ServerState,
    add_all,
    generate_response,
    request_id,
    server_state,
    tokenize,
)
from pagedkv.entrypoints.openai.validation import (
    check_context_length,
    parse_body,
    truncate_prompts,
)


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
    max_len = state.async_llm.engine.max_model_len
    cut = truncate_prompts(token_ids, req.truncate_prompt_tokens, max_len)
    # A truncated text prompt goes on as its ids (echo shows what the model saw).
    prompts = [c if len(c) < len(t) else p for p, t, c in zip(prompts, token_ids, cut)]
    token_ids = cut
    check_context_length(
        state.async_llm.engine.max_model_len,
        [len(t) for t in token_ids],
        req.requested_max_tokens(),
        "prompt",
    )
    engine_prompts = [
        {"prompt_token_ids": ids, "prompt": p} if isinstance(p, str) else {"prompt_token_ids": ids}
        for p, ids in zip(prompts, token_ids)
    ]
    renderer = CompletionRenderer(
        state,
        request_id=f"cmpl-{request_id(request)}",
        model=req.model or state.served_model_name,
        created=int(time.time()),
        n=params.n,
        top_k=req.logprobs,
        echo_text=[
            p if isinstance(p, str) else state.async_llm.tokenizer.decode(p) for p in prompts
        ]
        if req.echo
        else None,
        prompt_ids=token_ids,
    )
    streams = await add_all(
        state,
        renderer.request_id,
        engine_prompts,
        params,
        "prompt",
        req.cache_salt,
        req.structured_outputs_field(),
    )
    return await generate_response(
        request, renderer, streams, params, req.stream, req.stream_options, req.return_token_ids
    )


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
    prompt_ids: list[list[int]]  # per prompt, its token ids
    prompt_param: str = "prompt"
    # Per prompt: its output's prompt logprobs (from `observe`); choices whose first chunk went.
    prompt_lps: dict[int, PromptLogprobs] = field(default_factory=dict)
    started: set[tuple[int, int]] = field(default_factory=set)

    def echo(self, pi: int) -> str:
        return self.echo_text[pi] if self.echo_text is not None else ""

    def observe(self, pi: int, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_lps[pi] = out.prompt_logprobs

    def stream_choice(
        self,
        pi: int,
        c: CompletionOutput,
        text: str,
        t0: int,
        t1: int,
        text_offset: int,
        finished: bool,
    ) -> P.CompletionResponseChoice:
        first = (pi, c.index) not in self.started
        self.started.add((pi, c.index))
        # ``text_offset`` is where ``text`` starts in the generated text (negative in the first
        # chunk, whose text starts with the echo); logprobs' offsets index the choice's text
        # (echo + generated), so the generated token t0 starts at len(echo) + its position.
        echo_len = len(self.echo(pi))
        offset = echo_len + text_offset + (echo_len if first else 0)
        return P.CompletionResponseChoice(
            index=pi * self.n + c.index,
            text=text,
            logprobs=self._logprobs(pi, c, t0, t1, offset, first),
            finish_reason=c.finish_reason if finished else None,
            stop_reason=c.stop_reason if finished else None,
            prompt_logprobs=self._prompt_logprobs(pi) if first else None,
        )

    def stream_chunk(
        self, choices: list, usage: P.UsageInfo | None = None
    ) -> P.CompletionStreamResponse:
        return P.CompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def final_choice(self, pi: int, c: CompletionOutput, text: str) -> P.CompletionResponseChoice:
        return P.CompletionResponseChoice(
            index=pi * self.n + c.index,
            text=text,
            logprobs=self._logprobs(pi, c, 0, len(c.token_ids), len(self.echo(pi)), True),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_logprobs=self._prompt_logprobs(pi),
        )

    def response(
        self, choices: list, usage: P.UsageInfo, kv_transfer_params: dict[str, Any] | None = None
    ) -> P.CompletionResponse:
        return P.CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            kv_transfer_params=kv_transfer_params,
        )

    def _prompt_logprobs(self, pi: int) -> list[dict[str, P.PromptLogprob] | None] | None:
        """vLLM's choice ``prompt_logprobs``: token ids as JSON keys."""
        plp = self.prompt_lps.get(pi)
        if plp is None:
            return None
        return [
            None
            if d is None
            else {
                str(t): P.PromptLogprob(
                    logprob=v.logprob, rank=v.rank, decoded_token=v.decoded_token
                )
                for t, v in d.items()
            }
            for d in plp
        ]

    def _logprobs(
        self, pi: int, c: CompletionOutput, t0: int, t1: int, offset0: int, first: bool
    ) -> P.CompletionLogProbs | None:
        """Tokens ``t0:t1`` of ``c`` in completions' logprobs shape; ``offset0``: the text
        offset of token ``t0`` in the choice's text. In a choice's ``first`` part with
        ``echo``, the prompt tokens come first (from offset 0; the first has no logprob)."""
        k = self.top_k
        if k is None:
            return None
        lp = P.CompletionLogProbs()
        if first and self.echo_text is not None:
            plp = self.prompt_lps.get(pi) or []
            ids = self.prompt_ids[pi]
            self._add_tokens(
                lp, ids, [plp[i] if i < len(plp) else None for i in range(len(ids))], 0
            )
        self._add_tokens(lp, c.token_ids[t0:t1], (c.logprobs or [])[t0:t1], offset0)
        return lp

    def _add_tokens(
        self,
        lp: P.CompletionLogProbs,
        token_ids: list[int],
        dicts: list[dict[int, Logprob] | None],
        offset: int,
    ) -> None:
        """Append ``token_ids`` (``dicts[i]``: token ``i``'s logprobs, None or missing: null)."""
        k = self.top_k or 0
        for i, tid in enumerate(token_ids):
            d = dicts[i] if i < len(dicts) else None
            text = self.state.token_text(tid)
            chosen = d.get(tid) if d is not None else None
            lp.tokens.append(text)
            lp.token_logprobs.append(chosen.logprob if chosen is not None else None)
            if d is None or k == 0:
                lp.top_logprobs.append(None)
            else:
                top = sorted((x for x in d.items() if x[1].rank <= k), key=lambda x: x[1].rank)[:k]
                lp.top_logprobs.append({self.state.token_text(t): v.logprob for t, v in top})
            lp.text_offset.append(offset)
            offset += len(text)
