"""`StreamTracker` (forwarding/stream_resume.py): rewriting and continuing broken streams,
on hand-made SSE bytes (the real kill test is in test_proxy.py)."""

from __future__ import annotations

import json
from typing import Any

from pagedkv.forwarding.stream_resume import StreamTracker


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def events(out: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in out if e != b"data: [DONE]\n\n"]


def test_completion_stream_is_passed_through_without_token_ids_the_client_did_not_ask_for():
    t = StreamTracker.for_request({"prompt": "hi", "max_tokens": 5}, chat=False)
    raw = sse(
        {
            "id": "cmpl-1",
            "created": 7,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "text": "a",
                    "token_ids": [1],
                    "prompt_token_ids": [9, 8],
                    "finish_reason": None,
                }
            ],
        }
    )
    # Bytes may arrive split anywhere.
    out = t.feed(raw[:10]) + t.feed(raw[10:])
    (ev,) = events(out)
    assert ev["choices"][0]["text"] == "a" and "token_ids" not in ev["choices"][0]
    assert t.prompt_ids == {0: [9, 8]} and t.choices[0].token_ids == [1]
    assert t.unfinished() == [0]


def test_a_broken_completion_continues_from_prompt_plus_tokens_with_the_budget_left():
    body = {
        "prompt": "hi",
        "max_tokens": 5,
        "min_tokens": 3,
        "temperature": 0,
        "logprobs": 1,
        "kv_transfer_params": {"x": 1},
    }
    t = StreamTracker.for_request(body, chat=False)
    t.feed(
        sse(
            {
                "id": "c",
                "created": 1,
                "choices": [
                    {
                        "index": 0,
                        "text": "ab",
                        "token_ids": [1, 2],
                        "prompt_token_ids": [9],
                        "finish_reason": None,
                    }
                ],
            }
        )
    )
    path, cont = t.continuation(0)
    assert path == "/v1/completions"
    assert cont["prompt"] == [9, 1, 2] and cont["max_tokens"] == 3 and cont["min_tokens"] == 1
    assert cont["temperature"] == 0 and cont["logprobs"] == 1 and cont["n"] == 1
    assert "kv_transfer_params" not in cont
    # The continuation's chunks come back at the client's id, with shifted text offsets.
    t.start_attempt()
    out = t.feed(
        sse(
            {
                "id": "other",
                "created": 2,
                "choices": [
                    {
                        "index": 0,
                        "text": "c",
                        "token_ids": [3],
                        "prompt_token_ids": [9, 1, 2],
                        "logprobs": {
                            "tokens": ["c"],
                            "token_logprobs": [-0.5],
                            "top_logprobs": [{"c": -0.5}],
                            "text_offset": [0],
                        },
                        "finish_reason": "length",
                    }
                ],
            }
        ),
        {0: 0},
        True,
    )
    (ev,) = events(out)
    assert ev["id"] == "c" and ev["created"] == 1
    assert ev["choices"][0]["logprobs"]["text_offset"] == [2]
    assert t.unfinished() == [] and t.choices[0].token_ids == [1, 2, 3]


def test_chat_continuations_take_the_delta_shape_and_logprobs():
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 1,
        "return_token_ids": True,
    }
    t = StreamTracker.for_request(body, chat=True)
    out = t.feed(
        sse(
            {
                "id": "chat-1",
                "created": 3,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            }
        )
    )
    assert len(events(out)) == 1 and t.prelude_sent
    t.feed(
        sse(
            {
                "id": "chat-1",
                "created": 3,
                "prompt_token_ids": [5, 6],
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "Hi"},
                        "token_ids": [7],
                        "finish_reason": None,
                    }
                ],
            }
        )
    )
    path, cont = t.continuation(0)
    assert path == "/v1/completions" and cont["prompt"] == [5, 6, 7] and cont["max_tokens"] == 3
    assert cont["logprobs"] == 1
    t.start_attempt()
    out = t.feed(
        sse(
            {
                "id": "cmpl-9",
                "choices": [
                    {
                        "index": 0,
                        "text": "!",
                        "token_ids": [8],
                        "prompt_token_ids": [5, 6, 7],
                        "logprobs": {
                            "tokens": ["!"],
                            "token_logprobs": [-1.0],
                            "top_logprobs": [{"!": -1.0}],
                            "text_offset": [0],
                        },
                        "finish_reason": "stop",
                    }
                ],
            }
        ),
        {0: 0},
        True,
    )
    (ev,) = events(out)
    ch = ev["choices"][0]
    assert ev["object"] == "chat.completion.chunk" and ch["delta"] == {"content": "!"}
    assert ch["token_ids"] == [8] and "prompt_token_ids" not in ch
    assert ch["logprobs"]["content"][0]["token"] == "!" and ch["finish_reason"] == "stop"
    fin = events(t.finish(include_usage=True))
    assert fin[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_a_chat_stream_that_broke_before_any_token_restarts_and_drops_the_second_prelude():
    body = {"messages": [{"role": "user", "content": "x"}], "n": 2, "kv_transfer_params": {"a": 1}}
    t = StreamTracker.for_request(body, chat=True)
    t.feed(
        sse(
            {
                "id": "c1",
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                    for i in range(2)
                ],
            }
        )
    )
    assert t.unfinished() == [0, 1]
    path, cont = t.continuation(1)
    assert path == "/v1/chat/completions" and cont["n"] == 1 and "kv_transfer_params" not in cont
    t.start_attempt()
    out = t.feed(
        sse(
            {
                "id": "c2",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            }
        ),
        {0: 1},
    )
    assert out == []  # the client already has the role chunk
    out = t.feed(
        sse(
            {
                "id": "c2",
                "prompt_token_ids": [4],
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "z"},
                        "token_ids": [5],
                        "finish_reason": "stop",
                    }
                ],
            }
        ),
        {0: 1},
    )
    (ev,) = events(out)
    assert ev["id"] == "c1" and ev["choices"][0]["index"] == 1
    assert t.unfinished() == [0]


def test_error_events_break_the_stream_and_a_spent_budget_finishes_the_choice():
    t = StreamTracker.for_request({"prompt": [1, 2], "max_tokens": 1}, chat=False)
    t.feed(
        sse(
            {
                "id": "c",
                "choices": [
                    {
                        "index": 0,
                        "text": "a",
                        "token_ids": [3],
                        "prompt_token_ids": [1, 2],
                        "finish_reason": None,
                    }
                ],
            }
        )
    )
    out = t.feed(sse({"error": {"message": "engine died"}}) + sse({"id": "c", "choices": []}))
    assert out == [] and t.broken and t.error_event is not None
    assert t.continuation(0) is None  # its one token is already out
    (ev,) = events([t.finish_choice(0)])
    assert ev["choices"][0]["finish_reason"] == "length" and t.unfinished() == []


def test_multi_prompt_completions_map_choices_to_their_prompt():
    t = StreamTracker.for_request({"prompt": ["a", "b"], "n": 2, "max_tokens": 3}, chat=False)
    assert t.all_choice_indices() == [0, 1, 2, 3]
    t.feed(
        sse(
            {
                "id": "c",
                "choices": [
                    {
                        "index": 3,
                        "text": "q",
                        "token_ids": [7],
                        "prompt_token_ids": [11],
                        "finish_reason": None,
                    }
                ],
            }
        )
    )
    assert t.continuation(2)[1]["prompt"] == [11]  # same prompt (index 1) as choice 3
    assert t.continuation(3)[1]["prompt"] == [11, 7]
    assert t.continuation(0)[1]["prompt"] == "a"  # nothing known of prompt 0: from scratch


def test_continuous_usage_after_a_break_counts_every_token_the_client_got():
    body = {
        "prompt": [1],
        "max_tokens": 3,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    t = StreamTracker.for_request(body, chat=False)
    (ev,) = events(
        t.feed(
            sse(
                {
                    "id": "c",
                    "choices": [
                        {
                            "index": 0,
                            "text": "a",
                            "token_ids": [2],
                            "prompt_token_ids": [1],
                            "finish_reason": None,
                        }
                    ],
                    "usage": {
                        "prompt_tokens": 1,
                        "completion_tokens": 1,
                        "total_tokens": 2,
                        "prompt_tokens_details": {"cached_tokens": 0},
                    },
                }
            )
        )
    )
    assert ev["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # the engine's own
    t.start_attempt()
    (ev,) = events(
        t.feed(
            sse(
                {
                    "id": "d",
                    "choices": [{"index": 0, "text": "b", "token_ids": [3], "finish_reason": None}],
                    "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
                }
            ),
            {0: 0},
            True,
        )
    )
    assert ev["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
