"""Structured outputs through the live server: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` on completions and chat, streamed and not, ``n > 1``, the official
``openai`` client's ``parse`` (a pydantic model as the schema), and clear 400s for what does
not compile, each naming the request field it came from."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_utils import client as http_client
from server_utils import running_server

from pagedkv.engine.config import EngineConfig

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.fixture(scope="module")
def server():
    with running_server(EngineConfig(num_kv_blocks=256, max_model_len=512)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with http_client(server) as c:
        yield c


def streamed_text(http: httpx.Client, path: str, body: dict) -> list[str]:
    """Each choice's text, joined from an SSE stream."""
    texts: dict[int, str] = {}
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                piece = c["text"] if "text" in c else (c["delta"].get("content") or "")
                texts[c["index"]] = texts.get(c["index"], "") + piece
    return [texts[i] for i in sorted(texts)]


def test_chat_response_format_json_schema_and_json_object(http):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"messages": ASK, "temperature": 0, "max_tokens": 80, "response_format": rf}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    # Streamed: the deltas join into the same document.
    assert streamed_text(http, "/v1/chat/completions", body) == [choice["message"]["content"]]
    body["response_format"] = {"type": "json_object"}
    content = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert isinstance(json.loads(content["content"]), dict)


def test_completions_structured_outputs_each_kind(http):
    base = {"prompt": "Q: Is water wet?\nA:", "temperature": 0, "max_tokens": 40}
    cases = [
        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"regex": "[0-9]{2}-[a-z]{3}"}, lambda t: re.fullmatch("[0-9]{2}-[a-z]{3}", t)),
        ({"grammar": 'root ::= "A" [0-9] "!"'}, lambda t: re.fullmatch("A[0-9]!", t)),
        ({"grammar": 'start: "B" /[a-c]/'}, lambda t: re.fullmatch("B[a-c]", t)),  # Lark
        ({"json": PERSON, "disable_any_whitespace": True}, lambda t: "\n" not in t),
    ]
    for so, ok in cases:
        r = http.post("/v1/completions", json={**base, "structured_outputs": so})
        assert r.status_code == 200, (so, r.text)
        text = r.json()["choices"][0]["text"]
        assert ok(text), (so, text)
        if "json" in so:
            jsonschema.validate(json.loads(text), PERSON)
        assert streamed_text(http, "/v1/completions", {**base, "structured_outputs": so}) == [text]


def test_n_choices_each_follow_the_schema(http):
    body = {
        "messages": ASK,
        "n": 3,
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": 80,
        "structured_outputs": {"json": PERSON},
    }
    choices = http.post("/v1/chat/completions", json=body).json()["choices"]
    assert len(choices) == 3
    for c in choices:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
    for text in streamed_text(http, "/v1/chat/completions", body):
        jsonschema.validate(json.loads(text), PERSON)


def test_the_openai_client_parses_into_a_pydantic_model(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        completion = client.chat.completions.parse(
            model="SmolLM2-135M-Instruct",
            messages=ASK,
            response_format=Person,
            temperature=0,
            max_tokens=80,
        )
        person = completion.choices[0].message.parsed
        assert isinstance(person, Person) and 0 <= person.age <= 150
        # vLLM's field through extra_body, as vLLM's docs show it.
        choice = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
            max_tokens=5,
        )
        assert choice.choices[0].message.content in ("yes", "no")


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
            "nonsense",
        ),
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs", "nonsense"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "cannot compile"),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs", "nope"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "not both",
        ),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
        ({"response_format": {"type": "yaml"}}, "response_format", "type"),
        ({"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_what_does_not_compile_is_a_400_naming_its_field(http, path, extra, param, words):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": ASK}
    for stream in (False, True):
        err = error_of(http.post(path, json={**base, **extra, "max_tokens": 4, "stream": stream}))
        assert err["param"].split(".")[0] == param and words in err["message"], err
    assert http.get("/health").status_code == 200
