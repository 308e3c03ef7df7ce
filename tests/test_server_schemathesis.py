"""The OpenAPI document, and schemathesis run against the live server with it.

``/openapi.json`` is built from protocol.py's pydantic models (`openapi.build_openapi`): every
route's request body and every status and content type it answers. Schemathesis (`st run`,
every phase: examples, coverage, fuzzing, stateful where links exist) must find nothing: no 5xx,
no undocumented status or content type, no response off its schema, no schema-valid request
refused and no schema-invalid one accepted. The rules JSON Schema cannot state are in
tests/schemathesis_hooks.py (and each generation operation's description).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_utils import running_server

from pagedkv.engine.config import EngineConfig

TESTS = Path(__file__).resolve().parent
# A short context bounds each generated request's work (max_tokens <= 64), so the run fits.
CONFIG = EngineConfig(num_kv_blocks=256, max_num_seqs=8, max_model_len=64)


@pytest.fixture(scope="module")
def server():
    with running_server(CONFIG, enable_tokenizer_info_endpoint=True) as srv:
        yield srv


def test_the_document_declares_bodies_statuses_and_content_types(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    ops = {(p, m): op for p, o in doc["paths"].items() for m, op in o.items()}
    assert len({op["operationId"] for op in ops.values()}) == len(ops)
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        body = ops[(path, "post")]["requestBody"]["content"]["application/json"]["schema"]
        assert body  # the request model, not FastAPI's empty body
    comp = ops[("/v1/completions", "post")]
    assert set(comp["responses"]) == {"200", "400", "401", "404", "409", "413", "500", "503"}
    assert set(comp["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "best_of" in comp["description"]  # the rules JSON Schema cannot state
    assert set(ops[("/metrics", "get")]["responses"]["200"]["content"]) == {"text/plain"}
    schemas = doc["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]
    assert props["n"]["maximum"] == 128 and props["temperature"]["anyOf"][0]["minimum"] == 0
    assert props["model"]["anyOf"][0]["enum"] == ["SmolLM2-135M-Instruct"]
    ids = props["prompt"]["anyOf"][2]["items"]
    assert ids["minimum"] == 0 and ids["maximum"] == 49151  # this model's vocabulary
    err = schemas["ErrorResponse"]
    assert err["properties"]["error"]["$ref"].endswith("/ErrorInfo")


@pytest.mark.slow
def test_schemathesis_finds_nothing(server, tmp_path):
    """Every phase, ~1,700 generated requests (about 5 minutes on 2 cores); then the server is
    healthy and its KV pool all free."""
    st = Path(sys.executable).with_name("schemathesis")
    env = {
        **os.environ,
        "PYTHONPATH": str(TESTS),
        "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
        "PKV_ST_MAX_MODEL_LEN": str(CONFIG.max_model_len),
    }
    res = subprocess.run(
        [
            str(st),
            "run",
            server.url + "/openapi.json",
            "--max-examples",
            "10",
            "--seed",
            "1",
            "--generation-database",
            "none",
            "--request-timeout",
            "60",
            "--phases",
            "examples,coverage,fuzzing,stateful",
            "--report",
            "junit",
            "--report-dir",
            str(tmp_path),
        ],  # fmt: skip
        env=env,
        cwd=tmp_path,  # its cache directory (.schemathesis/) goes there
        capture_output=True,
        text=True,
        timeout=1200,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "No issues found" in out and " passed" in out
    assert httpx.get(server.url + "/health").status_code == 200
    pool = httpx.get(server.url + "/debug/kv_cache").json()
    assert pool["invariants_ok"] and pool["num_running"] == pool["num_waiting"] == 0
    assert pool["num_free_blocks"] == pool["num_blocks"] - 1
