"""The replicas' lifecycle: read and check their configs at start (`build_state`; a pagedkv
replica's ``GET /v1/kv_cache_config``, a vLLM replica's ``/metrics`` and ``/v1/models``), start their
event feeds, and a health loop that scrapes each one's /metrics (its load), takes a silent one
down (feed stopped, blocks forgotten) and brings a returning one up again (config checked anew:
refused if it differs; re-indexed from its replay socket). A restart between two probes is
caught by the config's ``started`` time changing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from pagedkv.router.index import PrefixIndex
from pagedkv.router.metrics import RouterMetrics, parse_replica_load
from pagedkv.router.replica import Replica, ReplicaConfig, ReplicaSpec
from pagedkv.router.scoring import RoutingPolicy
from pagedkv.router.state import CONFIG_PATH, RouterConfigError, RouterOptions, RouterState
from pagedkv.router.subscriber import EventFeed
from pagedkv.router.tokens import PromptTokenizer
from pagedkv.router.vllm_replica import apply_flags, config_from_vllm

VLLM_PATHS = ("/metrics", "/v1/models")  # what a vLLM replica's config is read from

logger = logging.getLogger(__name__)


class ReplicaConfigError(ValueError):
    """A replica answered, but its configuration cannot be used (the message says why)."""


def _config(spec: ReplicaSpec, options: RouterOptions, responses: dict[str, Any]) -> ReplicaConfig:
    """The replica's `ReplicaConfig` from its answers (httpx responses by path): pagedkv's
    ``CONFIG_PATH``, else (404) vLLM's ``/metrics`` and ``/v1/models``; then the router's
    flags (`vllm_replica.apply_flags`). `ReplicaConfigError` when it cannot be used."""
    r = responses[CONFIG_PATH]
    try:
        if r.status_code != 404:
            r.raise_for_status()
            cfg = ReplicaConfig.from_json(r.json(), spec)
        else:
            metrics, models = responses["/metrics"], responses["/v1/models"]
            metrics.raise_for_status()
            models.raise_for_status()
            cfg = config_from_vllm(metrics.text, models.json(), spec)
        return apply_flags(cfg, options.block_size, options.hash_algo, options.hash_seed)
    except ValueError as e:
        raise ReplicaConfigError(str(e)) from None


def fetch_config(client: Any, spec: ReplicaSpec, options: RouterOptions) -> ReplicaConfig:
    """The replica's `ReplicaConfig` (sync httpx client); httpx errors propagate."""
    responses = {CONFIG_PATH: client.get(spec.url + CONFIG_PATH)}
    if responses[CONFIG_PATH].status_code == 404:
        for path in VLLM_PATHS:
            responses[path] = client.get(spec.url + path)
    return _config(spec, options, responses)


async def afetch_config(client: Any, spec: ReplicaSpec, options: RouterOptions) -> ReplicaConfig:
    """`fetch_config` with an async httpx client."""
    responses = {CONFIG_PATH: await client.get(spec.url + CONFIG_PATH, timeout=5.0)}
    if responses[CONFIG_PATH].status_code == 404:
        for path in VLLM_PATHS:
            responses[path] = await client.get(spec.url + path, timeout=5.0)
    return _config(spec, options, responses)


def read_configs(
    specs: Sequence[ReplicaSpec], options: RouterOptions
) -> dict[str, ReplicaConfig | None]:
    """Every replica's config, polling until all answered or ``options.startup_timeout``
    passed (None: never answered: it starts down and the health loop brings it in later)."""
    import httpx

    out: dict[str, ReplicaConfig | None] = {s.url: None for s in specs}
    deadline = time.monotonic() + options.startup_timeout
    with httpx.Client(timeout=5.0) as client:
        while True:
            for s in specs:
                if out[s.url] is None:
                    try:
                        out[s.url] = fetch_config(client, s, options)
                    except httpx.HTTPStatusError as e:
                        raise RouterConfigError(
                            f"replica {s.url}: GET {e.request.url.path} answered "
                            f"{e.response.status_code}: is it a pagedkv or vLLM server (and, with "
                            f"--api-key, reachable without one)?"
                        ) from None
                    except ReplicaConfigError as e:
                        raise RouterConfigError(str(e)) from None
                    except (httpx.HTTPError, KeyError, ValueError):
                        pass
            if all(out.values()) or time.monotonic() >= deadline:
                return out
            time.sleep(0.5)


def check_compatible(
    spec: ReplicaSpec, cfg: ReplicaConfig, ref: ReplicaConfig, ref_url: str, policy: str
) -> str | None:
    """Why ``cfg`` cannot be routed with the reference (None: it can)."""
    diffs = cfg.differences(ref)
    if diffs:
        return f"replica {spec.url} differs from {ref_url}: " + "; ".join(diffs)
    if policy == "kv" and cfg.events is None:
        if cfg.kind == "vllm":  # vLLM does not publish its endpoints: the spec must name them
            return (
                f"replica {spec.url} (vLLM) needs its KV event endpoints: start it with "
                f'--kv-events-config \'{{"enable_kv_cache_events": true, "publisher": "zmq", '
                f'"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}}\' and give '
                f"--replica URL,events=tcp://HOST:5557,replay=tcp://HOST:5558"
            )
        return (
            f"replica {spec.url} publishes no KV events: start it with --enable-kv-cache-events "
            f"--kv-events-replay-endpoint tcp://HOST:PORT, or give --replica URL,events=tcp://HOST:PORT"
        )
    return None


def start_feed(state: RouterState, rep: Replica) -> EventFeed | None:
    cfg = rep.config
    if cfg is None or cfg.events is None:
        return None
    return EventFeed(
        rep.url,
        cfg.events,
        cfg.replay,
        state.index,
        state.lock,
        on_batch=state.metrics.on_batch,
        on_resync=state.metrics.on_resync,
    ).start()


async def bring_up(state: RouterState, rep: Replica) -> None:
    """A replica that answers again: re-read its config; refuse it if incompatible, else
    re-index it from its replay socket and put it back in rotation."""
    import httpx

    try:
        cfg = await afetch_config(state.client, rep.spec, state.options)
    except ReplicaConfigError as e:
        why = f"replica {rep.url}: {e}"
        if rep.refused != why:
            logger.error("refusing %s", why)
        rep.refused = why
        return
    except (httpx.HTTPError, KeyError, ValueError) as e:
        logger.warning("replica %s answers /metrics but not its config: %s", rep.url, e)
        return
    ref_url = next(iter(state.replicas))
    why = check_compatible(rep.spec, cfg, state.reference, ref_url, state.options.policy)
    if why is not None:
        if rep.refused != why:
            logger.error("refusing %s", why)
        rep.refused = why
        return
    rep.config, rep.refused = cfg, None
    feed = start_feed(state, rep)
    if feed is not None and not await asyncio.to_thread(
        feed.wait_synced, state.options.sync_timeout
    ):
        logger.warning(
            "replica %s: no KV event replay within %.0f s; routing to it on load only until it comes",
            rep.url,
            state.options.sync_timeout,
        )
    rep.feed, rep.up = feed, True
    logger.warning("replica %s is up (%d blocks indexed)", rep.url, state.index.num_blocks(rep.url))


async def take_down(state: RouterState, rep: Replica, why: str) -> None:
    """Out of rotation: stop its feed, then forget its blocks (in that order: a running feed
    could re-add them)."""
    if not rep.up:
        return
    rep.up = False
    logger.warning("replica %s is down (%s): its requests go elsewhere", rep.url, why)
    feed, rep.feed = rep.feed, None
    if feed is not None:
        await asyncio.to_thread(feed.stop)
    with state.lock:
        state.index.remove_replica(rep.url)


async def probe(state: RouterState, rep: Replica) -> None:
    """One health check: scrape /metrics (load); down on failure, up again on success. Skipped
    while another probe of the replica runs."""
    if rep.lock.locked():
        return
    async with rep.lock:
        await _probe(state, rep)


async def _probe(state: RouterState, rep: Replica) -> None:
    timeout = max(2.0, state.options.health_interval)
    try:
        r = await state.client.get(rep.url + "/metrics", timeout=timeout)
        ok = r.status_code == 200
        if ok:
            rep.scraped(parse_replica_load(r.text))
        if ok and rep.up and rep.config is not None:
            # A restart between two probes (same URL, new process): its old blocks are gone
            # and its events may come from new endpoints. Re-index it as a comeback.
            c = await state.client.get(rep.url + CONFIG_PATH, timeout=timeout)
            if c.status_code == 200 and c.json().get("started") != rep.config.started:
                await take_down(state, rep, "restarted")
    except Exception as e:  # any transport error means down
        rep.refused = None
        await take_down(state, rep, f"/metrics: {type(e).__name__}")
        return
    if not ok:
        await take_down(state, rep, f"/metrics: HTTP {r.status_code}")
    elif not rep.up:
        await bring_up(state, rep)


async def health_loop(state: RouterState) -> None:
    while True:
        await asyncio.gather(
            *(probe(state, r) for r in state.replicas.values()), return_exceptions=True
        )
        await asyncio.sleep(state.options.health_interval)


def refresh_gauges(state: RouterState, m: RouterMetrics) -> None:
    with state.lock:
        m.index_blocks.set(len(state.index))
        for u in state.replicas:
            m.replica_blocks.labels(u).set(state.index.num_blocks(u))
    for r in state.replicas.values():
        m.replica_up.labels(r.url).set(1 if r.up else 0)
        m.replica_refused.labels(r.url).set(1 if r.refused else 0)


def build_state(specs: Sequence[ReplicaSpec], options: RouterOptions) -> RouterState:
    """Read the replicas' configs, refuse incompatible ones (`RouterConfigError`), load the
    tokenizer. Feeds are not started yet."""
    if not specs:
        raise RouterConfigError("the router needs at least one replica")
    urls = [s.url for s in specs]
    if len(set(urls)) != len(urls):
        raise RouterConfigError(f"a replica is given twice: {urls}")
    configs = read_configs(specs, options)
    answered = [(s, c) for s, c in ((s, configs[s.url]) for s in specs) if c is not None]
    if not answered:
        raise RouterConfigError(
            f"no replica answered GET {CONFIG_PATH} (or, vLLM, /metrics and /v1/models) within "
            f"{options.startup_timeout:g} s: "
            f"{', '.join(urls)}"
        )
    ref_spec, ref = answered[0]
    for spec, cfg in answered:
        why = check_compatible(spec, cfg, ref, ref_spec.url, options.policy)
        if why is not None:
            raise RouterConfigError(f"refusing {why}")
    try:
        tokenizer = PromptTokenizer.from_path(options.tokenizer or ref.model_path)
    except (OSError, ValueError) as e:
        raise RouterConfigError(f"cannot load the tokenizer: {e}") from None
    replicas = {s.url: Replica(s, configs[s.url]) for s in specs}
    # The reference first: `bring_up` compares against the first replica's URL in messages.
    replicas = {ref_spec.url: replicas[ref_spec.url], **replicas}
    state = RouterState(
        replicas,
        ref,
        tokenizer,
        RoutingPolicy(options.policy, options.weights, options.seed),
        options,
        PrefixIndex(),
        threading.Lock(),
        RouterMetrics(),
    )
    state.metrics._refresh = lambda m: refresh_gauges(state, m)
    return state


def start_replicas(state: RouterState) -> None:
    """Start the feeds of the replicas that answered at start and wait for their replays."""
    for rep in state.replicas.values():
        if rep.config is None:
            continue
        rep.feed = start_feed(state, rep)
        rep.up = True
    for rep in state.replicas.values():
        if rep.feed is not None and not rep.feed.wait_synced(state.options.sync_timeout):
            logger.warning(
                "replica %s: no KV event replay within %.0f s", rep.url, state.options.sync_timeout
            )


def stop_replicas(state: RouterState) -> None:
    for rep in state.replicas.values():
        if rep.feed is not None:
            rep.feed.stop()
            rep.feed = None
