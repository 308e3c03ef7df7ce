"""/tokenize, /detokenize, /tokenizer_info, /version and /ping against a live server (httpx).

The shapes are vLLM's; lm-eval's remote tokenizer (``lm_eval.utils.RemoteTokenizer``) is replayed
request by request: it accepts a server whose ``/tokenizer_info`` has ``eos_token`` and whose
``/tokenize`` answers ``tokens``, then encodes with ``add_special_tokens: false`` and decodes.
"""

from __future__ import annotations

import httpx
import pytest
from server_utils import running_server

from pagedkv import __version__
from pagedkv.engine.config import EngineConfig

CONFIG = EngineConfig(num_kv_blocks=128, max_num_seqs=4, max_model_len=512)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def server():
    with running_server(CONFIG, enable_tokenizer_info_endpoint=True, api_key="k") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": "Bearer k"}) as c:
        yield c


@pytest.fixture(scope="module")
def tok(server):
    return server.app.state.pagedkv.async_llm.tokenizer


def test_tokenize_a_prompt_gives_the_engines_ids(http, tok):
    text = "Paged attention stores keys and values in blocks."
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] is None
    strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == [tok.id_to_token(i) for i in body["tokens"]]


def test_tokenize_messages_counts_what_a_chat_completion_runs(http, tok):
    r = http.post("/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    chat = http.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    )
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)


def test_tokenize_continue_final_message_and_a_custom_template(http, tok):
    msgs = [*MESSAGES, {"role": "assistant", "content": "The colour is"}]
    r = http.post(
        "/tokenize",
        json={"messages": msgs, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert r.status_code == 200, r.text
    text = tok.decode(r.json()["tokens"], skip_special_tokens=False)
    assert text.endswith("The colour is")  # open-ended: no end-of-turn after it
    custom = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    r = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": custom})
    assert r.json()["tokens"] == tok.encode(
        "[system] You are terse.\n[user] Name a colour.\n", add_special_tokens=False
    )


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
        ({"messages": MESSAGES, "chat_template": "{% for %}"}, "messages"),
        ({"messages": []}, "messages"),
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "model": "other"}, "model"),
    ],
)
def test_tokenize_refuses_bad_requests_naming_the_field(http, body, param):
    r = http.post("/tokenize", json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_detokenize_round_trips_and_names_a_bad_id(http, tok):
    ids = tok.encode("Hello, world!<|im_end|>")
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello, world!<|im_end|>"}
    r = http.post("/detokenize", json={"tokens": [ids[0], tok.vocab_size]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"
    r = http.post("/detokenize", json={"tokens": ["a"]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tokens")


def test_tokenizer_info_has_what_lm_eval_reads(http, tok):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.id_to_token(tok.eos_token_id)
    assert info["bos_token"] == tok.id_to_token(tok.bos_token_id)
    assert info["chat_template"] == tok.chat_template
    assert info["tokenizer_class"] and info["model_max_length"] == 512
    assert info["vocab_size"] == tok.vocab_size


def test_lm_eval_remote_tokenizer_flow(http, tok):
    """lm-eval's check_remote_tokenizer_support, then RemoteTokenizer's encode/decode/eos."""
    info = http.get("/tokenizer_info").json()
    assert isinstance(info, dict) and "eos_token" in info
    probe = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert isinstance(probe.json().get("tokens"), list)
    eos_id = http.post(
        "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}
    ).json()["tokens"][0]
    assert eos_id == tok.eos_token_id
    ids = http.post("/tokenize", json={"prompt": "The sky is", "add_special_tokens": False})
    text = http.post("/detokenize", json={"tokens": ids.json()["tokens"]}).json()["prompt"]
    assert text == "The sky is"


def test_version_and_ping_are_open(server):
    with httpx.Client(base_url=server.url, timeout=30) as anon:  # no API key
        assert anon.get("/version").json() == {"version": __version__}
        assert anon.get("/ping").status_code == 200 and anon.post("/ping").status_code == 200
        assert anon.post("/tokenize", json={"prompt": "x"}).status_code == 401


def test_tokenizer_info_is_opt_in():
    with running_server(CONFIG) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.get("/tokenizer_info")
        assert r.status_code == 404
        assert "--enable-tokenizer-info-endpoint" in r.json()["error"]["message"]
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 200
