"""Resuming a broken completion stream on another instance (`pagedkv proxy`'s mid-stream
failover; the router reuses it).

An instance that dies mid-stream leaves the client with part of an answer. The proxy asks every
streamed request for ``return_token_ids`` (vLLM's field), so it knows each choice's prompt token
ids and the tokens generated so far. When the stream breaks (transport error, or its end without
``[DONE]``) or carries an error event, each unfinished choice is *continued* elsewhere: a
``/v1/completions`` request whose prompt is the prompt's token ids followed by the choice's
tokens, ``max_tokens`` (and ``min_tokens``) less those already generated, ``n: 1``, the same
sampling fields. The continuation's chunks are rewritten into the client's stream (its id,
created time, choice index, chat's ``delta`` shape, text offsets) so that the client sees one
unbroken stream. A choice whose prompt ids never arrived (nothing streamed yet) is restarted from
the client's original prompt.

Contract: greedy decoding resumes token-exact (the continuation's prompt is exactly the model's
context at the break). Known differences from an unbroken stream: presence/frequency penalties
count only the continuation's tokens (the earlier ones are prompt); a stop string straddling the
break is not matched; text held back for a forming stop string at the break is lost; usage is
recomputed by the proxy (``cached_tokens`` omitted). Logprobs keep their shape (completions'
are passed through with shifted offsets; chat's are converted).

`StreamTracker` is pure (bytes in, bytes out), so it is tested without servers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Sampling fields a continuation keeps as the client sent them.
CONTINUED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "cache_salt",
    "user",
)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(slots=True)
class ChoiceState:
    """One choice of the client's stream: tokens and text sent so far, whether it finished."""

    token_ids: list[int] = field(default_factory=list)
    text_len: int = 0
    finished: bool = False
    started: bool = False  # a chunk of it reached the client (its first one carries prompt ids)


@dataclass(slots=True)
class StreamTracker:
    """Follows the SSE stream a client receives and rewrites what reaches it.

    ``feed`` takes raw bytes of an instance's stream and returns the events to send on; events
    are rewritten to the first stream's ``id``/``created``, token ids are removed unless the
    client asked for them, usage and ``[DONE]`` are held back (`finish` sends them).
    ``broken`` is set by an error event: the rest of that instance's stream is ignored."""

    body: dict[str, Any]  # the client's request
    chat: bool
    num_prompts: int
    n: int
    client_ids: bool = False  # the client asked for return_token_ids itself
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)  # per prompt index
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    response_id: str | None = None
    created: int | None = None
    prelude_sent: bool = False
    done: bool = False  # the instance sent [DONE]
    broken: bool = False  # the instance sent an error event
    error_event: bytes | None = None
    usage_seen: dict[str, Any] | None = None
    resumed: bool = False  # a second stream took over (usage is then recomputed)
    _buf: bytes = b""

    @classmethod
    def for_request(cls, body: dict[str, Any], chat: bool) -> StreamTracker:
        prompt = body.get("prompt")
        num_prompts = 1
        if (
            not chat
            and isinstance(prompt, list)
            and prompt
            and not all(isinstance(x, int) for x in prompt)
        ):
            num_prompts = len(prompt)
        n = body.get("n", 1) if isinstance(body.get("n", 1), int) else 1
        return cls(
            body=body,
            chat=chat,
            num_prompts=num_prompts,
            n=max(n, 1),
            client_ids=body.get("return_token_ids") is True,
        )

    # ---- the instance's stream -------------------------------------------------------------

    def start_attempt(self) -> None:
        """A new instance stream begins: forget the old one's partial bytes and flags."""
        self.resumed = self.resumed or self.response_id is not None
        self._buf, self.done, self.broken = b"", False, False

    def usage(self) -> dict[str, int]:
        """Usage of what the client got: each prompt once, every choice's tokens."""
        prompt = sum(len(self.prompt_ids.get(pi, [])) for pi in range(self.num_prompts))
        completion = sum(len(st.token_ids) for st in self.choices.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def feed(
        self, raw: bytes, choice_map: dict[int, int] | None = None, continuation: bool = False
    ) -> list[bytes]:
        """Events to send the client for ``raw`` bytes of the current stream. ``choice_map``
        maps the stream's choice index to the client's (a continuation has one choice);
        ``continuation``: the stream is a /v1/completions continuation to reshape."""
        self._buf += raw
        out: list[bytes] = []
        while b"\n\n" in self._buf and not self.broken:
            event, self._buf = self._buf.split(b"\n\n", 1)
            sent = self._event(event.decode("utf-8", "replace"), choice_map, continuation)
            if sent is not None:
                out.append(sent)
        return out

    def _event(
        self, event: str, choice_map: dict[int, int] | None, continuation: bool
    ) -> bytes | None:
        data = "\n".join(
            line[5:].lstrip() for line in event.splitlines() if line.startswith("data:")
        )
        if not data:
            return None
        if data == "[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            return None
        if "error" in chunk:  # the instance failed this request mid-stream: resume elsewhere
            self.broken, self.error_event = True, _sse(chunk)
            return None
        if self.response_id is None:
            self.response_id, self.created = chunk.get("id"), chunk.get("created")
        if chunk.get("usage") is not None:
            self.usage_seen = chunk["usage"]
        if self.chat and isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_ids[0] = list(chunk["prompt_token_ids"])
        choices = []
        for ch in chunk.get("choices") or []:
            rewritten = self._choice(ch, choice_map, continuation)
            if rewritten is not None:
                choices.append(rewritten)
        if not choices:
            return None  # usage-only, kv_transfer_params-only or a repeated prelude
        return _sse(self._chunk(chunk, choices, continuation))

    def _choice(
        self, ch: dict[str, Any], choice_map: dict[int, int] | None, continuation: bool
    ) -> dict[str, Any] | None:
        idx = (
            choice_map.get(ch.get("index", 0), -1) if choice_map is not None else ch.get("index", 0)
        )
        if idx < 0:
            return None
        st = self.choices.setdefault(idx, ChoiceState())
        if st.finished:
            return None
        pi = 0 if self.chat else idx // self.n
        if isinstance(ch.get("prompt_token_ids"), list) and not continuation:
            self.prompt_ids[pi] = list(ch["prompt_token_ids"])
        if (
            self.chat
            and not continuation
            and ch.get("delta", {}).get("role")
            and not ch.get("token_ids")
            and not ch["delta"].get("content")
            and ch.get("finish_reason") is None
        ):
            if self.prelude_sent:
                return None  # a retried chat stream's role chunk: the client has it
            self.prelude_sent = True
        new_ids = [int(t) for t in ch.get("token_ids") or []]
        text = (
            ch.get("text", "")
            if not self.chat or continuation
            else (ch.get("delta") or {}).get("content") or ""
        )
        out = self._reshape(ch, idx, text, continuation)
        first = not st.started and (new_ids or text or ch.get("finish_reason") is not None)
        if self.client_ids:
            out["token_ids"] = new_ids
            if first and not self.chat and pi in self.prompt_ids:
                out["prompt_token_ids"] = self.prompt_ids[pi]
        st.token_ids += new_ids
        st.text_len += len(text)
        st.started = st.started or bool(first)
        st.finished = ch.get("finish_reason") is not None
        return out

    def _reshape(
        self, ch: dict[str, Any], idx: int, text: str, continuation: bool
    ) -> dict[str, Any]:
        """The choice as the client's endpoint shapes it, at the client's index."""
        drop = ("token_ids", "prompt_token_ids")
        if not continuation:
            out = {k: v for k, v in ch.items() if k not in drop}
            out["index"] = idx
            return out
        st = self.choices[idx]
        lp = ch.get("logprobs")
        if self.chat:
            return {
                "index": idx,
                "delta": {"content": text} if text else {},
                "logprobs": _chat_logprobs(lp) if lp is not None else None,
                "finish_reason": ch.get("finish_reason"),
                "stop_reason": ch.get("stop_reason"),
            }
        if lp is not None and isinstance(lp.get("text_offset"), list):
            lp = dict(lp, text_offset=[o + st.text_len for o in lp["text_offset"]])
        return {
            "index": idx,
            "text": text,
            "logprobs": lp,
            "finish_reason": ch.get("finish_reason"),
            "stop_reason": ch.get("stop_reason"),
        }

    def _chunk(
        self, chunk: dict[str, Any], choices: list[dict[str, Any]], continuation: bool = False
    ) -> dict[str, Any]:
        out = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": chunk.get("model"),
            "choices": choices,
        }
        if chunk.get("usage") is not None and not continuation and not self.resumed:
            out["usage"] = chunk["usage"]  # continuous_usage_stats, the unbroken stream's own
        elif (self.body.get("stream_options") or {}).get("continuous_usage_stats"):
            out["usage"] = self.usage()
        if self.client_ids and self.chat and isinstance(chunk.get("prompt_token_ids"), list):
            out["prompt_token_ids"] = chunk["prompt_token_ids"]
        return out

    # ---- resumption ------------------------------------------------------------------------

    def all_choice_indices(self) -> list[int]:
        return list(range(self.num_prompts * self.n))

    def unfinished(self) -> list[int]:
        """The client's choices still to be generated."""
        return [
            i for i in self.all_choice_indices() if not self.choices.get(i, ChoiceState()).finished
        ]

    def continuation(self, idx: int) -> tuple[str, dict[str, Any]] | None:
        """``(path, body)`` continuing choice ``idx`` on another instance, or None when it has
        no tokens left (then `finish_choice` ends it)."""
        st = self.choices.get(idx, ChoiceState())
        pi = 0 if self.chat else idx // self.n
        body = {k: self.body[k] for k in CONTINUED_FIELDS if k in self.body}
        body.update(n=1, stream=True, return_token_ids=True)
        if self.chat and pi not in self.prompt_ids:  # nothing arrived: restart the chat request
            restart = {
                k: v
                for k, v in self.body.items()
                if k not in ("kv_transfer_params", "stream_options")
            }
            restart.update(n=1, stream=True, return_token_ids=True)
            return "/v1/chat/completions", restart
        remaining = self._max_tokens()
        if remaining is not None:
            remaining -= len(st.token_ids)
            if remaining <= 0:
                return None
            body["max_tokens"] = remaining
        if self.body.get("min_tokens"):
            body["min_tokens"] = max(0, int(self.body["min_tokens"]) - len(st.token_ids))
        if pi in self.prompt_ids:
            body["prompt"] = self.prompt_ids[pi] + st.token_ids
        else:  # completions whose first chunk never came: the client's prompt, from scratch
            prompt = self.body.get("prompt")
            body["prompt"] = prompt[pi] if self.num_prompts > 1 else prompt  # type: ignore[index]
        lp = self._logprobs()
        if lp is not None:
            body["logprobs"] = lp
        return "/v1/completions", body

    def _max_tokens(self) -> int | None:
        if self.chat:
            v = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        else:
            v = self.body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        return v if isinstance(v, int) else None

    def _logprobs(self) -> int | None:
        if self.chat:
            return (self.body.get("top_logprobs") or 0) if self.body.get("logprobs") else None
        v = self.body.get("logprobs")
        return v if isinstance(v, int) else None

    def finish_choice(self, idx: int, reason: str = "length") -> bytes:
        """An event ending choice ``idx`` (its token budget ran out at the break)."""
        st = self.choices.setdefault(idx, ChoiceState())
        st.finished = True
        ch: dict[str, Any] = (
            {"index": idx, "delta": {}, "logprobs": None}
            if self.chat
            else {"index": idx, "text": "", "logprobs": None}
        )
        ch.update(finish_reason=reason, stop_reason=None)
        return _sse(self._chunk({"model": self.body.get("model")}, [ch]))

    def finish(self, include_usage: bool) -> list[bytes]:
        """The closing events: usage (recomputed from the tokens the client got) when asked,
        then ``[DONE]``."""
        out = []
        if include_usage:
            usage = self.usage()
            if not self.resumed and self.usage_seen is not None:
                usage = self.usage_seen  # the unbroken stream's own (with cached_tokens)
            out.append(
                _sse(
                    {
                        "id": self.response_id,
                        "object": "chat.completion.chunk" if self.chat else "text_completion",
                        "created": self.created,
                        "model": self.body.get("model"),
                        "choices": [],
                        "usage": usage,
                    }
                )
            )
        out.append(b"data: [DONE]\n\n")
        return out


def _chat_logprobs(lp: dict[str, Any]) -> dict[str, Any]:
    """Completions' logprobs (tokens, token_logprobs, top_logprobs) in chat's shape."""
    content = []
    for tok, logprob, top in zip(
        lp.get("tokens") or [],
        lp.get("token_logprobs") or [],
        lp.get("top_logprobs") or [None] * len(lp.get("tokens") or []),
    ):
        content.append(
            {
                "token": tok,
                "logprob": logprob if logprob is not None else float("-inf"),
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode())}
                    for t, v in (top or {}).items()
                ],
            }
        )
    return {"content": content}


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


__all__ = ["ChoiceState", "StreamTracker"]
