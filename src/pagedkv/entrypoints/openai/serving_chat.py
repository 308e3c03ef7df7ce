"""``POST /v1/chat/completions``: messages, rendered with the model's chat template, to choices.

The template is rendered and tokenized on a worker thread (a huge conversation never stalls the
event loop). A stream opens with one chunk giving every choice its role, as OpenAI's does;
``logprobs: true`` with ``top_logprobs: k`` gives the sampled token's logprob and the top ``k``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedkv.engine.outputs import CompletionOutput
from pagedkv.entrypoints.openai import protocol as P
from pagedkv.entrypoints.openai.errors import bad_request
from pagedkv.entrypoints.openai.serving_engine import (
    ChoiceRenderer,
    ServerState,
    add_all,
    generate_response,
    request_id,
    server_state,
)
from pagedkv.entrypoints.openai.validation import (
    check_context_length,
    parse_body,
    truncate_prompts,
)


async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, P.ChatCompletionRequest)
    state.check_model(req.model)
    images: list[str] = []
    try:
        params = req.to_sampling_params()
        conversation = req.conversation(state.image_placeholder, images)
    except P.RequestError as e:
        raise bad_request(e.message, e.param) from None
    text, token_ids = await _render(state, conversation, req.add_generation_prompt)
    max_len = state.async_llm.engine.max_model_len
    (cut,) = truncate_prompts([token_ids], req.truncate_prompt_tokens, max_len)
    if images and len(cut) != len(token_ids):
        raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", "messages")
    prompt: dict[str, Any] = {"prompt_token_ids": cut}
    if len(cut) == len(token_ids):
        prompt["prompt"] = text
    num_tokens = len(cut)
    if images:
        prompt["multi_modal_data"] = {"image": [state.image_source(u) for u in images]}
        if req.ec_transfer_params is not None:
            prompt["ec_transfer_params"] = req.ec_transfer_params.to_dict()
        # Each image token becomes its placeholder run later: budget the context with it.
        processor = state.async_llm.engine.mm_processor
        num_tokens += len(images) * (processor.image_seq_length - 1)
    check_context_length(
        state.async_llm.engine.max_model_len,
        [num_tokens],
        req.requested_max_tokens(),
        "messages",
    )
    renderer = ChatRenderer(
        state,
        request_id=f"chatcmpl-{request_id(request)}",
        model=req.model or state.served_model_name,
        created=int(time.time()),
        n=params.n,
        top_k=params.logprobs,
    )
    streams = await add_all(
        state,
        renderer.request_id,
        [prompt],
        params,
        "messages",
        req.cache_salt,
        req.structured_outputs_field(),
    )
    return await generate_response(
        request, renderer, streams, params, req.stream, req.stream_options, req.return_token_ids
    )


async def _render(
    state: ServerState, conversation: list[dict[str, str]], add_generation_prompt: bool
) -> tuple[str, list[int]]:
    """The prompt text and its token ids (off the event loop); a 400 naming ``messages`` when
    there is no tokenizer or the template fails."""
    tok = state.async_llm.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer, so no chat template", "messages")

    def render() -> tuple[str, list[int]]:
        text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
        return text, tok.encode(text, add_special_tokens=False)

    try:
        return await asyncio.to_thread(render)
    except Exception as e:
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None


@dataclass
class ChatRenderer(ChoiceRenderer):
    """Chat completions' choices and responses (see `ChoiceRenderer`)."""

    state: ServerState
    request_id: str
    model: str
    created: int
    n: int
    top_k: int | None  # top_logprobs when logprobs is true; None: no logprobs
    prompt_param: str = "messages"
    prompt_ids_on_choice: bool = False

    def stream_prelude(self) -> list[P.ChatCompletionStreamResponse]:
        # The role first, for every choice (OpenAI sends it before any content).
        return [
            self.stream_chunk(
                [
                    P.ChatCompletionStreamChoice(
                        index=i, delta=P.DeltaMessage(role="assistant", content="")
                    )
                    for i in range(self.n)
                ]
            )
        ]

    def stream_choice(
        self,
        pi: int,
        c: CompletionOutput,
        text: str,
        t0: int,
        t1: int,
        text_offset: int,
        finished: bool,
    ) -> P.ChatCompletionStreamChoice:
        return P.ChatCompletionStreamChoice(
            index=c.index,
            delta=P.DeltaMessage(content=text) if text else P.DeltaMessage(),
            logprobs=self._logprobs(c, t0, t1),
            finish_reason=c.finish_reason if finished else None,
            stop_reason=c.stop_reason if finished else None,
        )

    def stream_chunk(
        self, choices: list, usage: P.UsageInfo | None = None
    ) -> P.ChatCompletionStreamResponse:
        return P.ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def final_choice(
        self, pi: int, c: CompletionOutput, text: str
    ) -> P.ChatCompletionResponseChoice:
        return P.ChatCompletionResponseChoice(
            index=c.index,
            message=P.ChatResponseMessage(content=text),
            logprobs=self._logprobs(c, 0, len(c.token_ids)),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def response(
        self, choices: list, usage: P.UsageInfo, kv_transfer_params: dict[str, Any] | None = None
    ) -> P.ChatCompletionResponse:
        return P.ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            kv_transfer_params=kv_transfer_params,
        )

    def _logprobs(self, c: CompletionOutput, t0: int, t1: int) -> P.ChatCompletionLogProbs | None:
        """Tokens ``t0:t1`` of ``c`` in chat's logprobs shape."""
        k = self.top_k
        if k is None:
            return None
        content = []
        for i in range(t0, t1):
            tid = c.token_ids[i]
            d = c.logprobs[i] if c.logprobs is not None and i < len(c.logprobs) else {}
            text = self.state.token_text(tid)
            chosen = d.get(tid)
            top = sorted((x for x in d.items() if x[1].rank <= k), key=lambda x: x[1].rank)[:k]
            content.append(
                P.ChatLogprobContent(
                    token=text,
                    logprob=chosen.logprob if chosen is not None else float("-inf"),
                    bytes=list(text.encode()),
                    top_logprobs=[
                        P.ChatTopLogprob(
                            token=self.state.token_text(t),
                            logprob=v.logprob,
                            bytes=list(self.state.token_text(t).encode()),
                        )
                        for t, v in top
                    ],
                )
            )
        return P.ChatCompletionLogProbs(content=content)


async def create_encode(request: Request) -> Response:
    """``POST /v1/encode`` (an encoder instance, EPD): the chat request's images encoded and
    kept for a prefill instance; answers their ``ec_transfer_params``."""
    state = server_state(request)
    req = await parse_body(request, P.ChatCompletionRequest)
    state.check_model(req.model)
    images: list[str] = []
    try:
        req.conversation(state.image_placeholder, images)
    except P.RequestError as e:
        raise bad_request(e.message, e.param) from None
    if not images:
        raise bad_request("the messages carry no image to encode", "messages")
    engine = state.async_llm.engine
    token = engine.mm_processor.image_token_id
    prompt = {"multi_modal_data": {"image": [state.image_source(u) for u in images]}}
    try:
        _, items = await asyncio.to_thread(engine.process_images, prompt, [token] * len(images))
        params = await state.async_llm.run_in_engine(lambda e: e.encode_images(items))
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    body = P.EncodeResponse(
        ec_transfer_params=params,
        num_images=len(items),
        encoder_tokens=sum(i.feature.length for i in items),
    )
    return JSONResponse(body.model_dump())
