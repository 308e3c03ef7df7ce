"""The live KV-cache dashboard: ``GET /dashboard`` (one HTML page, no external assets) and
``GET /dashboard/state`` (the JSON it polls every 500 ms).

The state is taken on the engine thread between two steps (`AsyncLLM.run_in_engine`), so the
block map is consistent: every block of the pool is exactly one of

* ``n`` the null block (block 0, never allocated),
* ``f`` free (``ref_cnt == 0``, no hash: holds nothing reusable),
* ``c`` cached and evictable (``ref_cnt == 0`` with a block hash: a future prefix hit, evicted
  LRU-first when the pool needs room),
* ``u`` in use by one request (``ref_cnt == 1``),
* ``s`` shared by several requests (``ref_cnt > 1``: prefix hits, ``n > 1`` samples),

sent as one character per block (``"blocks"``). Hovering a block shows its details, sent
compactly beside the map:

* ``"ref_cnt"``: one integer per block;
* ``"hashes"``: block id (as a JSON key) -> the first 16 hex digits of its block hash (without
  the group id), for the blocks that have one;
* ``"owner_ids"`` (running requests' ids) and ``"owners"``: block id -> indexes into
  ``owner_ids`` of the requests whose block tables hold it (blocks held only by a finished
  request whose tier stores are still in flight have ``ref_cnt > 0`` and no owner).
* ``"block_groups"``: block id -> index of the KV cache group the block serves (the group of
  the block tables holding it, else of its hash), for blocks that are held or cached.

The pool is shared by every KV cache group (one per layer type or window of a hybrid model);
``"groups"`` lists them in group order: ``kind`` (vLLM's spec kind: ``full_attention``,
``sliding_window``, ``chunked_local_attention``, ``mla_attention``, ``mamba``, ...),
``num_layers``, ``block_size``, ``sliding_window`` / ``attention_chunk_size`` (null when not
windowed), ``page_size_bytes`` and ``num_blocks`` (blocks of the map attributed to it).

The page also shows, over time (a time axis on every chart): KV usage and prefix-cache hit
rate (per polling interval and cumulative), prompt and generation throughput, TTFT and
inter-token latency p50 / p99 (``"latency"``: the server's `ServerMetrics.latency_summary`
over the last 30 s), running and waiting requests; the running requests (tokens and blocks
each) and, with offload tiers, each tier's usage, hits and traffic (``"tiers"``: tier name ->
its `TierStats` fields; null without tiers) and, with a PD connector (`NixlConnector`), its
transfers (``"kv_transfer"``: `kv_transfer_state`; null without one). The numbers come from one
`SchedulerStats` snapshot (`LLMEngine.make_stats`).
``GET /`` redirects to ``/dashboard``.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from pagedkv.core.hashing import get_block_hash, get_group_id
from pagedkv.engine.multimodal import encoder_cache_state

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.stats import SchedulerStats

MAX_LISTED_REQUESTS = 64
STATE_CHARS = {"null": "n", "free": "f", "cached": "c", "used": "u", "shared": "s"}
HASH_HEX_DIGITS = 16  # enough to tell blocks apart on screen; the full hash is 64


def block_states(engine: LLMEngine) -> str:
    """One character per block (see the module docstring). Call on the engine thread."""
    chars = []
    for b in engine.kv_cache_manager.block_pool.blocks:
        if b.is_null:
            chars.append("n")
        elif b.ref_cnt > 1:
            chars.append("s")
        elif b.ref_cnt == 1:
            chars.append("u")
        elif b.block_hash is not None:
            chars.append("c")
        else:
            chars.append("f")
    return "".join(chars)


def block_details(engine: LLMEngine) -> dict[str, Any]:
    """``ref_cnt``, ``hashes``, ``owner_ids`` and ``owners`` of the block map (see the module
    docstring). Call on the engine thread."""
    pool = engine.kv_cache_manager.block_pool
    ref_cnt = [b.ref_cnt for b in pool.blocks]
    hashes = {
        str(b.block_id): get_block_hash(b.block_hash).hex()[:HASH_HEX_DIGITS]
        for b in pool.blocks
        if b.block_hash is not None
    }
    block_groups = {
        str(b.block_id): get_group_id(b.block_hash) for b in pool.blocks if b.block_hash is not None
    }
    owner_ids: list[str] = []
    owners: dict[str, list[int]] = {}
    kv = engine.kv_cache_manager
    for req in list(engine.scheduler.running):
        try:
            groups = kv.get_block_ids(req.request_id)
        except Exception:  # no blocks (yet): nothing to attribute
            continue
        index = len(owner_ids)
        owner_ids.append(req.request_id)
        for gid, group in enumerate(groups):
            for block_id in group:
                if block_id:  # block 0 is the null block
                    block_groups[str(block_id)] = gid
        for block_id in {b for group in groups for b in group if b}:
            owners.setdefault(str(block_id), []).append(index)
    return dict(
        ref_cnt=ref_cnt,
        hashes=hashes,
        owner_ids=owner_ids,
        owners=owners,
        block_groups=block_groups,
    )


def kv_cache_groups_info(engine: LLMEngine) -> list[dict[str, Any]]:
    """The KV cache groups in group order: ``kind``, ``num_layers``, ``block_size``,
    ``sliding_window``, ``attention_chunk_size`` (null when not windowed) and
    ``page_size_bytes`` (also served by ``/v1/kv_cache_config``)."""
    out = []
    for g in engine.kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        rep = getattr(
            spec, "representative", spec
        )  # a UniformTypeKVCacheSpecs' rules are its layers'
        out.append(
            dict(
                kind=spec.kind,
                num_layers=len(g.layer_names),
                block_size=spec.block_size,
                sliding_window=getattr(rep, "sliding_window", None),
                attention_chunk_size=getattr(rep, "attention_chunk_size", None),
                page_size_bytes=spec.page_size_bytes,
            )
        )
    return out


def group_states(engine: LLMEngine, block_groups: dict[str, int]) -> list[dict[str, Any]]:
    """``"groups"`` of the state: `kv_cache_groups_info` plus ``num_blocks``, the blocks of
    ``block_groups`` (from `block_details`) attributed to each."""
    out = kv_cache_groups_info(engine)
    for g in out:
        g["num_blocks"] = 0
    for gid in block_groups.values():
        out[gid]["num_blocks"] += 1
    return out


def kv_transfer_state(stats: SchedulerStats) -> dict[str, Any] | None:
    """``"kv_transfer"`` of the state: a PD connector's role, connected peers, transfers in
    flight and cumulative transfers, failures, expired leases and bytes; None without a PD
    connector (no connector, or an offloading one)."""
    kcs = stats.kv_connector_stats
    t = kcs.transfer if kcs is not None else None
    if t is None:
        return None
    return dict(
        role=t.role,
        peers=list(t.peers),
        transfers_in_flight=t.transfers_in_flight,
        transfers=t.num_transfers,
        failures=t.num_failed,
        leases_expired=t.num_leases_expired,
        bytes=t.num_bytes,
    )


def dashboard_state(engine: LLMEngine, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON of ``/dashboard/state``. Call on the engine thread."""
    blocks = block_states(engine)
    stats = engine.make_stats()
    kv = engine.kv_cache_manager
    sched = engine.scheduler
    running = []
    for req in list(sched.running)[:MAX_LISTED_REQUESTS]:
        try:
            nblocks = len(kv.get_block_ids(req.request_id)[0])
        except Exception:
            nblocks = 0
        running.append(
            dict(
                id=req.request_id,
                prompt_tokens=req.num_prompt_tokens,
                output_tokens=req.num_output_tokens,
                computed_tokens=req.num_computed_tokens,
                cached_tokens=max(getattr(req, "num_cached_tokens", 0), 0),
                blocks=nblocks,
            )
        )
    waiting = [
        dict(id=r.request_id, prompt_tokens=r.num_prompt_tokens, preempted=r.num_preemptions > 0)
        for r in list(sched.waiting)[:MAX_LISTED_REQUESTS]
    ]
    counts = {name: blocks.count(ch) for name, ch in STATE_CHARS.items() if name != "null"}
    pc = stats.prefix_cache_stats
    tiers = stats.kv_connector_stats.tier_dicts() if stats.kv_connector_stats is not None else {}
    state = dict(
        time=time.time(),
        num_blocks=len(blocks),
        block_size=engine.block_size,
        blocks=blocks,
        counts=counts,
        usage=stats.kv_cache_usage,
        prefix_cache=dict(queries=pc.queries, hits=pc.hits, hit_rate=pc.hit_rate),
        num_running=stats.num_running_reqs,
        num_waiting=stats.num_waiting_reqs,
        num_preemptions=stats.num_preemptions,
        prompt_tokens=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens,
        running=running,
        waiting=waiting,
        tiers=tiers or None,
        kv_transfer=kv_transfer_state(stats),
        encoder_cache=encoder_cache_state(engine),
        **block_details(engine),
    )
    state["groups"] = group_states(engine, state["block_groups"])
    if extra:
        state.update(extra)
    return state


def dashboard_html() -> str:
    return (
        resources.files("pagedkv.entrypoints").joinpath("static/dashboard.html").read_text("utf-8")
    )


def add_routes(app: FastAPI) -> None:
    html_cache: dict[str, str] = {}

    async def page(_: Request) -> Response:
        if "html" not in html_cache:
            html_cache["html"] = dashboard_html()
        return HTMLResponse(html_cache["html"], headers={"Cache-Control": "no-cache"})

    async def root(_: Request) -> Response:
        return RedirectResponse("/dashboard", status_code=307)

    async def state(request: Request) -> Response:
        st = request.app.state.pagedkv
        llm = st.async_llm
        pub = st.kv_event_publisher
        extra = dict(
            model=st.served_model_name,
            healthy=llm.is_healthy,
            latency=st.metrics.latency_summary(time.monotonic()),
            max_num_seqs=llm.engine.config.max_num_seqs,
            max_queue_size=llm.max_queue_size,
            num_aborted=llm.num_aborted,
            num_rejected=llm.num_rejected,
            kv_events=None
            if pub is None
            else dict(
                endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, next_seq=pub.next_seq
            ),
        )
        data = await llm.run_in_engine(lambda engine: dashboard_state(engine, extra))
        return JSONResponse(data, headers={"Cache-Control": "no-store"})

    app.add_api_route("/", root, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/dashboard/state", state, methods=["GET"])
