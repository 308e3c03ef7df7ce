"""The router's FastAPI app: OpenAI's API in and out, each request sent to the replica that
`RoutingPolicy` picks from the global `PrefixIndex` and the replicas' loads.

Life of the app (replicas: lifecycle.py, shared state: state.py):

* `create_router_app` reads every replica's ``GET /v1/kv_cache_config`` (`build_state`): the
  first answering replica is the reference; another whose `MUST_AGREE` fields differ makes it
  raise `RouterConfigError` (the command exits 2 with the differing fields), and so does, with
  ``policy="kv"``, a replica without KV events. One `EventFeed` per replica fills the index.
* A health loop scrapes each replica's /metrics (its load), takes a silent one down and brings a
  returning one up again (refused if its config now differs; re-indexed from its replay socket).
* A request: the prompt's token ids (`PromptTokenizer`) → block hashes (`prompt_block_hashes`
  with the reference's block size, algorithm and seed) → ``index.match`` → ``policy.choose``
  over the replicas that are up. The forwarding the PD proxy uses too
  (`pagedkv.forwarding.run_decode`) carries it: streams passed through chunk by chunk (and
  resumed elsewhere if they break), a failing replica (no connection, 5xx) skipped for the next one in `fallback_order`,
  a 4xx returned as it is. A chosen replica that failed is probed at once: if it does not
  answer it is taken down and forgotten. Response headers ``x-pagedkv-replica`` (the replica that
  answered), ``x-pagedkv-route-reason`` and ``x-pagedkv-predicted-cached-tokens`` (its
  predicted hit) say what the router did.
* Prefill/decode pools (``decode`` given): the scored replicas are the prefill instances; the
  chosen one (then the others) prefills, and `pagedkv.forwarding.handle_completion` carries the
  request to the decode pool (round-robin).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET
/health`` (200 while a replica is up), ``GET /metrics`` (see metrics.py), ``GET
/router/state`` (replicas, index size, recent decisions with predicted and reported hits).

Predicted hit tokens mirror the engine's rule: a prompt's cache hit stops before its last token
(``KVCacheManager.get_computed_blocks``), in whole blocks.
"""

# No ``from __future__ import annotations``: routes are defined inside create_router_app with
# fastapi imported there (as in entrypoints/proxy.py), and FastAPI resolves string annotations
# in module globals only.

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.forwarding import (
    Instance,
    InstancePool,
    ProxyState,
    forward_headers,
    handle_completion,
    instance_client,
    invalid_body,
    run_decode,
    unavailable,
)
from pagedkv.router.hashing import prompt_block_hashes
from pagedkv.router.index import PrefixMatch
from pagedkv.router.lifecycle import build_state, health_loop, probe, start_replicas, stop_replicas
from pagedkv.router.replica import Replica, ReplicaSpec
from pagedkv.router.scoring import ReplicaLoad, RoutingDecision
from pagedkv.router.state import RouterConfigError, RouterOptions, RouterState
from pagedkv.router.subscriber import describe
from pagedkv.router.tokens import PromptInfo

__all__ = ["RouterConfigError", "RouterOptions", "RouterState", "create_router_app"]

logger = logging.getLogger(__name__)

# ---- routing ------------------------------------------------------------------------------------


def predicted_tokens(hit_blocks: int, num_prompt_tokens: int, block_size: int) -> int:
    """Cached tokens a replica should report: the predicted blocks, at most the whole blocks
    before the prompt's last token (the engine always computes that one)."""
    return min(hit_blocks, max(0, num_prompt_tokens - 1) // block_size) * block_size


def decide(
    state: RouterState, hashes: list[int]
) -> tuple[Replica, RoutingDecision, dict[str, PrefixMatch], dict[str, ReplicaLoad]] | None:
    """The policy's choice among the replicas that are up (None: none is), and the matches."""
    candidates = state.up()
    if not candidates:
        return None
    with state.lock:
        matches = state.index.match(hashes)
    loads = {r.url: r.current_load() for r in candidates}
    d = state.policy.choose(
        [r.url for r in candidates], len(hashes), matches, loads, state.block_size
    )
    state.metrics.decisions.labels(state.policy.policy, d.reason, d.replica).inc()
    return state.replicas[d.replica], d, matches, loads


def cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI usage object, if present."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or not isinstance(details.get("cached_tokens"), int):
        return None
    return details["cached_tokens"]


@dataclass(slots=True)
class Routed:
    """One request's bookkeeping from dispatch to its answer's end. ``rep`` is the policy's
    choice (its load counts the request); ``served``/``predicted`` are the replica that
    answered (the choice, or a fallback when it failed) and its predicted cached tokens."""

    state: RouterState
    rep: Replica
    decision: RoutingDecision
    request_id: str
    num_prompt_tokens: int
    num_blocks: int
    matches: dict[str, PrefixMatch]
    loads: dict[str, ReplicaLoad]
    served: str = ""
    predicted: int = 0
    done: bool = False

    def __post_init__(self) -> None:
        self.serve(self.rep.url)

    def serve(self, url: str) -> None:
        m = self.matches.get(url)
        self.served = url
        self.predicted = predicted_tokens(
            m.total_blocks if m else 0, self.num_prompt_tokens, self.state.block_size
        )

    def dispatch(self) -> None:
        self.rep.started(self.num_blocks)

    def finish(self, usage: Any) -> None:
        """Release the in-flight load (once) and record the reported hit, if any."""
        if self.done:
            return
        self.done = True
        self.rep.finished(self.num_blocks)
        reported = cached_tokens(usage)
        if reported is not None:
            self.state.metrics.record_usage(self.served, self.predicted, reported)
        self.state.decisions.append(
            {
                "request_id": self.request_id,
                "replica": self.served,
                "chosen": self.rep.url,
                "reason": self.decision.reason,
                "prompt_tokens": self.num_prompt_tokens,
                "predicted_cached_tokens": self.predicted,
                "reported_cached_tokens": reported,
                "cost": round(self.decision.cost, 3),
                "hit_blocks": {u: m.total_blocks for u, m in self.matches.items()},
                "loads": {
                    u: [ld.num_running, ld.num_waiting, ld.active_blocks]
                    for u, ld in self.loads.items()
                },
            }
        )

    def headers(self) -> dict[str, str]:
        return {
            "x-pagedkv-replica": self.served,
            "x-pagedkv-route-reason": self.decision.reason,
            "x-pagedkv-predicted-cached-tokens": str(self.predicted),
        }


def _usage_in_sse(lines: list[bytes]) -> Any:
    """The last non-null ``usage`` object among SSE ``data:`` lines, or None."""
    usage: Any = None
    for line in lines:
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                u = json.loads(line[6:]).get("usage")
            except (ValueError, AttributeError):
                continue
            usage = u if u is not None else usage
    return usage


async def _watched(
    routed: Routed, body: AsyncIterator[bytes], record: bool
) -> AsyncIterator[bytes]:
    """A stream's bytes as they come, watching its SSE lines for a usage object; the request's
    bookkeeping ends with the stream (also when the client goes away)."""
    usage: Any = None
    pending = b""
    try:
        async for chunk in body:
            data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
            *lines, pending = (pending + data).split(b"\n")
            usage = _usage_in_sse(lines) or usage
            yield chunk
    finally:
        routed.finish(usage if record else None)


def watch(routed: Routed, response: Any, record: bool) -> Any:
    """``response`` with the router's headers; ``routed.finish`` runs when its body is done
    (a stream: at its end). ``record``: its usage is the predicted replica's to compare."""
    from fastapi.responses import StreamingResponse

    response.headers.update(routed.headers())
    if isinstance(response, StreamingResponse):
        response.body_iterator = _watched(routed, response.body_iterator, record)
        return response
    usage = None
    if record and response.status_code == 200:
        try:
            usage = json.loads(response.body).get("usage")
        except (ValueError, AttributeError):
            pass
    routed.finish(usage)
    return response


def fallback_order(
    state: RouterState, chosen: Replica, matches: dict[str, PrefixMatch]
) -> list[Replica]:
    """The policy's choice, then the other replicas that are up, longest predicted prefix first:
    where a request goes when its choice fails."""
    rest = [r for r in state.up() if r is not chosen]
    rest.sort(key=lambda r: -(matches[r.url].total_blocks if r.url in matches else 0))
    return [chosen, *rest]


def _pool(role: str, replicas: list[Replica], cooldown: float) -> InstancePool:
    """A one-request `InstancePool` trying ``replicas`` in this order."""
    return InstancePool(role, [Instance(r.url) for r in replicas], cooldown)


def _after_failover(state: RouterState, routed: Routed, served_url: str | None) -> None:
    """Note who served; if not the choice, count a retry and probe the choice now (a dead one
    is taken down and forgotten at once, a busy one stays)."""
    if served_url == routed.rep.url:
        return
    state.metrics.retries.labels(routed.rep.url).inc()
    asyncio.get_running_loop().create_task(probe(state, routed.rep))
    if served_url is not None:
        routed.serve(served_url)


async def route_colocated(
    state: RouterState,
    request: Any,
    path: str,
    body: dict[str, Any],
    prompt: PromptInfo | None,
    hashes: list[int],
) -> Any:
    """The policy's choice serves the request; the proxy's `run_decode` forwards it (streams
    passed through, resumed elsewhere if they break), trying `fallback_order` on failure."""
    picked = decide(state, hashes)
    if picked is None:
        return unavailable(f"no replica is available ({len(state.replicas)} configured)")
    rep, d, matches, loads = picked
    headers = forward_headers(request, str(uuid.uuid4()))
    routed = Routed(
        state,
        rep,
        d,
        headers["X-Request-Id"],
        len(prompt.token_ids) if prompt else 0,
        len(hashes),
        matches,
        loads,
    )
    pool = _pool("replica", fallback_order(state, rep, matches), state.options.cooldown)
    routed.dispatch()
    try:
        inst, response = await run_decode(
            ProxyState(prefill=pool, decode=pool, client=state.client),
            "POST",
            path,
            body,
            headers,
            bool(body.get("stream")),
        )
    except BaseException:
        routed.finish(None)
        raise
    _after_failover(state, routed, inst.url if inst else None)
    return watch(routed, response, inst is not None)


async def route_disaggregated(
    state: RouterState, request: Any, path: str, prompt: PromptInfo | None, hashes: list[int]
) -> Any:
    """PD pools: the KV policy orders the prefill instances (its choice first); the proxy's
    `handle_completion` then prefills there and decodes on the decode pool (round-robin)."""
    picked = decide(state, hashes)
    if picked is None:
        return unavailable("no prefill instance is available")
    rep, d, matches, loads = picked
    pstate = ProxyState(
        prefill=_pool("prefill", fallback_order(state, rep, matches), state.options.cooldown),
        decode=state.decode,
        client=state.client,
    )
    routed = Routed(
        state, rep, d, "", len(prompt.token_ids) if prompt else 0, len(hashes), matches, loads
    )
    routed.dispatch()
    try:
        response = await handle_completion(pstate, request, path)
    except BaseException:
        routed.finish(None)
        raise
    prefill_url = None
    if pstate.served:
        routed.request_id, prefill_url, _ = pstate.served[-1]
    _after_failover(state, routed, prefill_url)
    return watch(
        routed, response, False
    )  # the usage is the decode's; the prefill's stays in the proxy


async def handle(state: RouterState, request: Any, path: str) -> Any:
    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return invalid_body()
    prompt = await asyncio.to_thread(state.tokenizer.prompt, path, body)
    ref = state.reference
    hashes = (
        []
        if prompt is None
        else prompt_block_hashes(
            prompt.token_ids,
            ref.block_size,
            ref.hash_algo,
            ref.hash_seed,
            cache_salt=prompt.cache_salt,
        )
    )
    if state.decode is not None:
        return await route_disaggregated(state, request, path, prompt, hashes)
    return await route_colocated(state, request, path, body, prompt, hashes)


def state_json(state: RouterState) -> dict[str, Any]:
    """``GET /router/state``."""
    with state.lock:
        blocks = {u: state.index.num_blocks(u) for u in state.replicas}
        size = len(state.index)
    return {
        "policy": state.policy.policy,
        "block_size": state.block_size,
        "hash_algo": state.reference.hash_algo,
        "hash_seed": state.reference.hash_seed,
        "index_blocks": size,
        "replicas": [
            {
                "url": r.url,
                "kind": None if r.config is None else r.config.kind,
                "up": r.up,
                "refused": r.refused,
                "indexed_blocks": blocks[r.url],
                "inflight": r.inflight,
                "load": {
                    "num_running": r.load.num_running,
                    "num_waiting": r.load.num_waiting,
                    "kv_usage": r.load.kv_usage,
                },
                "events": describe(r.feed),
            }
            for r in state.replicas.values()
        ],
        "decisions": list(state.decisions)[-200:],
    }


def create_router_app(
    replicas: Sequence[str | ReplicaSpec],
    options: RouterOptions | None = None,
    decode: Sequence[str] | None = None,
) -> Any:
    """The router's FastAPI app over ``replicas`` (``URL[,events=...][,replay=...]`` or
    `ReplicaSpec`s). With ``decode`` (instance URLs) the replicas are the prefill pool of a PD
    deployment. Raises `RouterConfigError` (see the module docstring) before serving."""
    import contextlib

    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    options = options or RouterOptions()
    specs = [s if isinstance(s, ReplicaSpec) else ReplicaSpec.parse(s) for s in replicas]
    state = build_state(specs, options)
    client = instance_client(options.timeout)
    state.client = client
    if decode:
        state.decode = InstancePool.from_urls("decode", list(decode), options.cooldown)
    start_replicas(state)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(health_loop(state))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.to_thread(stop_replicas, state)
            await client.aclose()

    app = FastAPI(title="pagedkv KV-aware router", lifespan=lifespan)
    app.state.router = state

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(state, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(state, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        up = state.up()
        if not up:
            return unavailable("no replica is available")
        pool = state.decode or InstancePool("replica", [Instance(r.url) for r in up])
        pstate = ProxyState(prefill=pool, decode=pool, client=client)
        return (
            await run_decode(
                pstate,
                "GET",
                "/v1/models",
                None,
                forward_headers(request, str(uuid.uuid4())),
                stream=False,
            )
        )[1]

    @app.get("/health")
    async def health() -> Response:
        if state.up():
            return Response(status_code=200)
        return unavailable("no replica is up")

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/state")
    async def router_state() -> Response:
        from fastapi.responses import JSONResponse

        return JSONResponse(state_json(state))

    return app
