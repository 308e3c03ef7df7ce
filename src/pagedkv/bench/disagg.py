"""Prefill/decode (PD) disaggregation: PD vs colocated serving, KV transfer, a kill test.

Colocated vs PD serving, KV transfer bandwidth vs memcpy, and a kill test, all in one run on
this machine.

1. Colocated baseline: one ``pagedkv serve`` pinned to two cores (``taskset -c A,B``).
2. PD: a producer (``kv_producer``) pinned to core A, a consumer (``kv_consumer``) pinned to core
   B, both with the `NixlConnector` (pull; ``--backend nixl|tcp``, default nixl when it
   imports), and ``pagedkv proxy`` (unpinned) in front. Both setups get the same total CPU.
   Pinning is skipped, with a note in the JSON, when ``taskset`` is missing or fewer than two
   CPUs are usable.
3. Workload (the same requests, same arrival times, against both setups): ``--num-requests``
   streamed completions, Poisson arrivals at ``--rate`` req/s (``--seed``), a prefill-heavy mix:
   a ``--long-fraction`` of prompts of ``--long-len`` random ordinary token ids, the rest of
   ``--short-len``; greedy, ``ignore_eos``, exactly ``--max-tokens`` new tokens. Per setup: TTFT
   and inter-token latency (ITL, per token: a chunk's gap divided by the tokens it carries)
   p50 / p99, output tokens/s, completed / failed; and PD / colocated ratios. Target: ITL p99 at
   least 2x lower with PD (``itl_p99`` ratio <= 0.5).
4. Transfer bandwidth: two KV buffers shaped like SmolLM2's (``LBNHC``, 30 layers, 3 KV heads,
   head size 64, float32, one region per layer), registered with two transfer agents in two
   processes (the remote one spawned); ``--bandwidth-mib`` of scattered blocks pulled with
   ``read_blocks``, against a torch copy of the same bytes in the same run (``memcpy``: one
   copy per layer of contiguous blocks; ``index_copy``: gather + scatter of the same scattered
   block ids). Target: transfer / memcpy >= 0.5.
5. Kill test (``--kill-test N``, 0 skips): 2 producers + 2 consumers behind the proxy; N
   requests at ``--kill-rate`` req/s while a background thread SIGKILLs one random instance and
   restarts it (same ports), one at a time, so both decode instances are never down together.
   Instance i is pinned to CPU i mod n with one compute thread (on 2 CPUs one producer and one
   consumer per core). A request is lost when it gets no 200, an error chunk, no ``[DONE]`` or
   fewer tokens than asked. Target: 0 lost.

Every process is started with fixed ports and stopped by PID at the end (also on Ctrl-C or
SIGTERM); each one's output goes to a log file under a temporary directory (kept with
``--keep-logs``). Progress goes to standard error; standard output holds the table and the JSON.

Usage: pagedkv bench disagg (or python benchmarks/bench_disagg.py) [--num-requests 32] [--rate 2]
       [--max-tokens 32] [--backend nixl|tcp] [--bandwidth-mib 64] [--kill-test 20] [--json-only]
       [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.bench.common import (
    BenchOptionError,
    add_output_args,
    int_range,
    log,
    ratio,
    run_and_emit,
)
from pagedkv.bench.instances import CLI, Cluster, Instance, free_port, pin_cores, stop_on_sigterm
from pagedkv.bench.serving import dist, positive_float

TOKEN_RANGE = (1000, 40000)  # ordinary BPE tokens, no special ones
HTTP_TIMEOUT_S = 600.0
TARGET_ITL_P99_RATIO = 0.5  # PD / colocated
TARGET_BANDWIDTH_RATIO = 0.5  # transfer / memcpy
# SmolLM2-135M's KV shape (LBNHC): layers, KV heads, head size (K and V interleave in C).
KV_LAYERS, KV_HEADS, HEAD_SIZE, KV_BLOCK_SIZE = 30, 3, 64, 16


# ---- results -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Req:
    """One workload request: its prompt and its arrival time (seconds after the run starts)."""

    prompt: list[int]
    arrival_s: float


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class ServingResult:
    """One setup's run of the workload (latencies in seconds)."""

    name: str
    completed: int
    failed: int
    errors: list[str]
    duration_s: float
    output_tokens: int
    output_tok_s: float
    ttft_s: dict[str, float]
    itl_s: dict[str, float]
    e2e_s: dict[str, float]
    kv_transfers: float | None = None  # PD: transfers the consumer(s) completed
    kv_transfer_failures: float | None = None


@dataclass(slots=True)
class BandwidthResult:
    backend: str
    agents: str  # "two processes"
    block_bytes: int
    blocks: int
    bytes_moved: int
    repeats: int
    transfer_gbps: float  # median over repeats, GB = 1e9 bytes
    memcpy_gbps: float
    index_copy_gbps: float
    ratio_vs_memcpy: float
    ratio_vs_index_copy: float
    verified: bool  # the pulled blocks hold the remote's bytes


@dataclass(slots=True)
class KillEvent:
    at_s: float
    instance: str
    restart_s: float | None  # None: it did not come back


@dataclass(slots=True)
class KillTestResult:
    requests: int
    completed: int
    lost: int
    errors: list[str]
    error_counts: dict[str, int]  # lost requests by kind (digits masked), to see what loses them
    duration_s: float
    kills: list[KillEvent]
    pinning: dict[str, Any]  # cores per instance [prefill0, prefill1, decode0, decode1], and a note


# ---- processes -----------------------------------------------------------------------------------


def pinning() -> tuple[list[int] | None, list[int] | None, list[int] | None, str | None]:
    """(colocated cores, prefill cores, decode cores, note): two CPUs A, B of this process's
    affinity: colocated on both, prefill on A, decode on B; all None (and why) when impossible."""
    if shutil.which("taskset") is None:
        return None, None, None, "taskset not found: instances unpinned"
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None, None, f"only {len(cpus)} usable CPU: instances unpinned"
    a, b = cpus[:2]
    return [a, b], [a], [b], None


def serve_argv(args: argparse.Namespace, port: int, kv_role: str | None = None) -> list[str]:
    """``pagedkv serve`` on ``port``; with ``kv_role`` a `NixlConnector` instance (pull)."""
    argv = [
        *CLI,
        "serve",
        "--port",
        str(port),
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--log-stats-interval",
        "0",
        "--max-queue-size",
        str(max(args.num_requests, args.kill_test, 1) + 8),
    ]
    if kv_role is not None:
        extra = {
            "backend": args.backend,
            "transfer_mode": "pull",
            "handshake_timeout_s": 5.0,
            "transfer_timeout_s": 10.0,
        }
        cfg = {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": extra,
        }
        argv += [
            "--kv-transfer-config",
            json.dumps(cfg),
            "--kv-side-channel-port",
            str(free_port()),
        ]
    return argv


def server(
    args: argparse.Namespace, logs: Path, name: str, kv_role: str | None, cores: list[int] | None
) -> Instance:
    port = free_port()
    return Instance(name, serve_argv(args, port, kv_role), port, logs / f"{name}.log", cores)


def proxy(logs: Path, name: str, prefill: list[Instance], decode: list[Instance]) -> Instance:
    """``pagedkv proxy`` (unpinned); a short cooldown so a restarted instance is used again soon,
    and a retry window longer than a restart on a loaded 2-core machine (up to ~2 min)."""
    port = free_port()
    argv = [
        *CLI,
        "proxy",
        "--port",
        str(port),
        "--cooldown",
        "1",
        "--timeout",
        "300",
        "--retry-window",
        "180",
        "--log-level",
        "info",
        "--prefill",
        *[p.url for p in prefill],
        "--decode",
        *[d.url for d in decode],
    ]
    return Instance(name, argv, port, logs / f"{name}.log")


# ---- workload and client -------------------------------------------------------------------------


def make_workload(args: argparse.Namespace, n: int, rate: float, seed: int) -> list[Req]:
    """``n`` prompts of random ordinary token ids (``--long-fraction`` of them ``--long-len``
    long, the rest ``--short-len``) with Poisson arrival times at ``rate`` req/s."""
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(n):
        lo, hi = args.long_len if rng.random() < args.long_fraction else args.short_len
        prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(rng.randint(lo, hi))]
        if i > 0:
            t += rng.expovariate(rate)
        reqs.append(Req(prompt, t))
    return reqs


async def stream_request(
    client: Any, prompt: list[int], max_tokens: int, model: str
) -> RequestResult:
    """One streamed completion; ok only with a 200, no error chunk, ``[DONE]`` and exactly
    ``max_tokens`` tokens (``ignore_eos``): anything else is a lost request."""
    payload = dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        stream=True,
        stream_options=dict(include_usage=True, continuous_usage_stats=True),
    )
    res = RequestResult(ok=False)
    t0 = last_t = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                tokens = (chunk.get("usage") or {}).get("completion_tokens", res.output_tokens)
                if not chunk.get("choices") or tokens == res.output_tokens:
                    continue
                now = time.perf_counter()
                new = tokens - res.output_tokens
                if res.ttft is None:
                    res.ttft = now - t0
                else:
                    res.itl.extend([(now - last_t) / new] * new)
                last_t, res.output_tokens = now, tokens
    except Exception as e:  # any transport failure: the request is lost
        res.error = f"{type(e).__name__}: {e}"
        return res
    finally:
        res.e2e = time.perf_counter() - t0
    if not done:
        res.error = "stream ended without [DONE]"
    elif res.output_tokens != max_tokens:
        res.error = f"{res.output_tokens} of {max_tokens} tokens"
    res.ok = res.error is None
    return res


async def drive(
    url: str, reqs: list[Req], max_tokens: int, model: str
) -> tuple[list[RequestResult], float]:
    """Every request at its arrival time; (results in workload order, duration in seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=len(reqs) + 4, max_keepalive_connections=len(reqs) + 4)
    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(HTTP_TIMEOUT_S), limits=limits
    ) as client:
        start = time.perf_counter()
        tasks = []
        for req in reqs:
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.ensure_future(stream_request(client, req.prompt, max_tokens, model))
            )
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def model_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]


def warm_up(url: str, model: str, args: argparse.Namespace) -> None:
    """A short and a long request, outside the measurements (first-call allocations; for PD the
    connector's handshake)."""
    reqs = make_workload(args, 2, 1.0, args.seed + 99_999)
    reqs[0].prompt = reqs[0].prompt[:8]
    reqs[1].prompt = [TOKEN_RANGE[0] + i for i in range(args.long_len[0])]
    for req in reqs:
        asyncio.run(drive(url, [Req(req.prompt, 0.0)], min(args.max_tokens, 4), model))


def transfer_counters(urls: list[str]) -> tuple[float, float]:
    """(transfers completed, transfers failed) summed over the instances' ``/metrics``."""
    import httpx

    done = failed = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=30).text
        for name, acc in (("kv_transfer_transfers", "done"), ("kv_transfer_failures", "failed")):
            m = re.search(rf"^\S*{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
            if m and acc == "done":
                done += float(m.group(1))
            elif m:
                failed += float(m.group(1))
    return done, failed


def summarize(name: str, results: list[RequestResult], duration: float) -> ServingResult:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    return ServingResult(
        name=name,
        completed=len(ok),
        failed=len(results) - len(ok),
        errors=sorted({r.error for r in results if r.error})[:3],
        duration_s=duration,
        output_tokens=out_tok,
        output_tok_s=out_tok / duration if duration > 0 else 0.0,
        ttft_s=dist([r.ttft for r in ok if r.ttft is not None]),
        itl_s=dist([x for r in ok for x in r.itl]),
        e2e_s=dist([r.e2e for r in ok]),
    )


def measure(
    name: str,
    url: str,
    reqs: list[Req],
    args: argparse.Namespace,
    consumers: tuple[Instance, ...] = (),
) -> ServingResult:
    model = model_name(url)
    warm_up(url, model, args)
    before = transfer_counters([c.url for c in consumers])
    log(args, f"{name}: {len(reqs)} requests ...")
    results, duration = asyncio.run(drive(url, reqs, args.max_tokens, model))
    out = summarize(name, results, duration)
    if consumers:
        after = transfer_counters([c.url for c in consumers])
        out.kv_transfers, out.kv_transfer_failures = after[0] - before[0], after[1] - before[1]
    log(args, f"{name}: {out.completed} ok, {out.failed} failed in {duration:.1f} s")
    return out


def run_colocated(
    args: argparse.Namespace, logs: Path, reqs: list[Req], cores: list[int] | None
) -> ServingResult:
    inst = server(args, logs, "colocated", None, cores)
    log(args, "starting the colocated instance ...")
    with Cluster([inst]):
        return measure("colocated", inst.url, reqs, args)


def run_pd(
    args: argparse.Namespace,
    logs: Path,
    reqs: list[Req],
    prefill_cores: list[int] | None,
    decode_cores: list[int] | None,
) -> ServingResult:
    p = server(args, logs, "pd-prefill", "kv_producer", prefill_cores)
    d = server(args, logs, "pd-decode", "kv_consumer", decode_cores)
    front = proxy(logs, "pd-proxy", [p], [d])
    log(args, "starting the PD pair and the proxy ...")
    with Cluster([p, d]), Cluster([front]):
        return measure("pd", front.url, reqs, args, consumers=(d,))


# ---- transfer bandwidth --------------------------------------------------------------------------


def kv_buffer(num_blocks: int, seed: int, layout: str = "LBNHC") -> Any:
    """A SmolLM2-shaped KV buffer in ``layout`` filled with a pattern unique to ``seed``."""
    import torch

    from pagedkv.ops.kv_cache import allocate_kv_cache

    buf, _ = allocate_kv_cache(
        layout, KV_LAYERS, num_blocks, KV_BLOCK_SIZE, KV_HEADS, HEAD_SIZE, torch.float32
    )
    buf.view(-1).copy_(torch.arange(buf.numel(), dtype=torch.float32) + seed * 1e6)
    return buf


def _remote_agent(
    backend: str, name: str, num_blocks: int, to_parent: Any, stop: Any, layout: str = "LBNHC"
) -> None:
    """The remote engine (a spawned process): registers its KV (pattern 2), sends its metadata,
    then polls its agent until ``stop`` is set, as an engine does every step (UCX needs the
    target to make progress: connection wire-up, and the data itself on transports without
    one-sided reads)."""
    from pagedkv.kv_transfer.nixl_connector import buffer_regions
    from pagedkv.transfer import get_transfer_backend

    be = get_transfer_backend(name, backend)
    try:
        buf = kv_buffer(num_blocks, 2, layout)
        be.register_kv_memory(buffer_regions(buf, layout))
        to_parent.put(be.get_agent_metadata())
        deadline = time.monotonic() + 600
        while not stop.is_set() and time.monotonic() < deadline:
            be.get_new_notifs()
    finally:
        be.shutdown()


def _wait_xfer(be: Any, handle: int) -> str:
    deadline = time.monotonic() + 120
    while (state := be.check_xfer_state(handle)) == "PROC":
        if time.monotonic() > deadline:
            return "TIMEOUT"
    return state


def _timed_copies(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up)."""
    import statistics

    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_bandwidth(args: argparse.Namespace) -> BandwidthResult:
    """Pull ``--bandwidth-mib`` of scattered blocks from a spawned agent; torch copies of the
    same bytes in this process as the baseline."""
    import torch

    from pagedkv.kv_transfer.nixl_connector import buffer_regions
    from pagedkv.transfer import get_transfer_backend

    layout = getattr(args, "kv_layout", "LBNHC")
    bd = layout.index("B")  # the block dimension of the buffer
    block_bytes = KV_LAYERS * KV_BLOCK_SIZE * KV_HEADS * 2 * HEAD_SIZE * 4
    n = max(1, math.ceil(args.bandwidth_mib * 2**20 / block_bytes))
    num_blocks = 2 * n + 1
    rng = random.Random(args.seed)
    local_ids, remote_ids = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
    ctx = mp.get_context("spawn")
    to_parent, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(
        target=_remote_agent,
        daemon=True,
        args=(
            args.backend,
            f"bw-remote-{uuid.uuid4().hex[:8]}",
            num_blocks,
            to_parent,
            stop,
            layout,
        ),
    )
    child.start()
    be = get_transfer_backend(f"bw-local-{uuid.uuid4().hex[:8]}", args.backend)
    try:
        buf = kv_buffer(num_blocks, 1, layout)
        be.register_kv_memory(buffer_regions(buf, layout))
        peer = be.add_remote_agent(to_parent.get(timeout=300))

        def pull() -> None:
            h = be.read_blocks(peer, local_ids, remote_ids)
            state = _wait_xfer(be, h)
            be.release_xfer(h)
            if state != "DONE":
                raise RuntimeError(f"transfer ended {state}")

        t_xfer = _timed_copies(pull, args.bandwidth_repeats)
        expected = kv_buffer(num_blocks, 2, layout)
        li, ri = torch.tensor(local_ids), torch.tensor(remote_ids)
        verified = torch.equal(buf.index_select(bd, li), expected.index_select(bd, ri))
    finally:
        be.shutdown()
        stop.set()
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
    src, dst = expected, kv_buffer(num_blocks, 3, layout)
    t_memcpy = _timed_copies(
        lambda: dst.narrow(bd, 0, n).copy_(src.narrow(bd, n, n)), args.bandwidth_repeats
    )
    t_index = _timed_copies(
        lambda: dst.index_copy_(bd, li, src.index_select(bd, ri)), args.bandwidth_repeats
    )
    moved = n * block_bytes
    gbps = [moved / t / 1e9 for t in (t_xfer, t_memcpy, t_index)]
    return BandwidthResult(
        backend=be.kind,
        agents="two processes",
        block_bytes=block_bytes,
        blocks=n,
        bytes_moved=moved,
        repeats=args.bandwidth_repeats,
        transfer_gbps=gbps[0],
        memcpy_gbps=gbps[1],
        index_copy_gbps=gbps[2],
        ratio_vs_memcpy=gbps[0] / gbps[1],
        ratio_vs_index_copy=gbps[0] / gbps[2],
        verified=verified,
    )


# ---- kill test -----------------------------------------------------------------------------------


class Killer(threading.Thread):
    """SIGKILLs one random server every ``interval`` seconds and restarts it, waiting until it is
    ready before the next kill: one instance down at most, so never both decode instances."""

    def __init__(self, servers: list[Instance], interval: tuple[float, float], seed: int) -> None:
        super().__init__(daemon=True, name="killer")
        self.servers, self.interval, self.rng = servers, interval, random.Random(seed)
        self.stop_event = threading.Event()
        self.lock = threading.Lock()  # held while killing + starting: `shutdown` waits for it
        self.events: list[KillEvent] = []
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop_event.wait(self.rng.uniform(*self.interval)):
            victim = self.rng.choice(self.servers)
            with self.lock:
                if self.stop_event.is_set():
                    return
                at = time.monotonic()
                victim.kill()
                victim.start()
            event = KillEvent(at - self.t0, victim.name, None)
            self.events.append(event)
            try:
                victim.wait_ready()
            except RuntimeError:
                return  # shut down meanwhile, or it did not come back: stop killing
            event.restart_s = time.monotonic() - at

    def shutdown(self) -> None:
        """No kill or start after this returns."""
        self.stop_event.set()
        with self.lock:
            pass


def run_kill_test(args: argparse.Namespace, logs: Path) -> KillTestResult:
    cores, note = pin_cores(4)
    servers = [server(args, logs, f"kill-prefill{i}", "kv_producer", cores[i]) for i in range(2)]
    servers += [
        server(args, logs, f"kill-decode{i}", "kv_consumer", cores[2 + i]) for i in range(2)
    ]
    front = proxy(logs, "kill-proxy", servers[:2], servers[2:])
    reqs = make_workload(args, args.kill_test, args.kill_rate, args.seed + 1)
    log(args, "kill test: starting 2 prefill + 2 decode instances and the proxy ...")
    with Cluster(servers), Cluster([front]):
        model = model_name(front.url)
        warm_up(front.url, model, args)
        killer = Killer(servers, args.kill_interval, args.seed)
        log(args, f"kill test: {len(reqs)} requests while killing instances ...")
        try:
            killer.start()
            results, duration = asyncio.run(drive(front.url, reqs, args.max_tokens, model))
        finally:
            killer.shutdown()
    ok = sum(r.ok for r in results)
    log(args, f"kill test: {ok} ok, {len(results) - ok} lost, {len(killer.events)} kills")
    return KillTestResult(
        requests=len(results),
        completed=ok,
        lost=len(results) - ok,
        errors=sorted({r.error for r in results if r.error})[:5],
        error_counts=error_kinds(r.error for r in results if not r.ok),
        duration_s=duration,
        kills=list(killer.events),
        pinning=dict(cores=cores, note=note),
    )


def error_kinds(errors: Iterable[str | None]) -> dict[str, int]:
    """Count errors by kind (the message's first 80 characters with every number masked), most
    frequent first."""
    return dict(
        Counter(re.sub(r"\d+", "N", e or "no error recorded")[:80] for e in errors).most_common()
    )


# ---- report --------------------------------------------------------------------------------------


def ratios(pd: ServingResult, colo: ServingResult) -> dict[str, float | None]:
    """PD / colocated for each headline figure (< 1 is better for latencies, > 1 for tokens/s)."""
    return dict(
        ttft_p50=ratio(pd.ttft_s["p50"], colo.ttft_s["p50"]),
        ttft_p99=ratio(pd.ttft_s["p99"], colo.ttft_s["p99"]),
        itl_p50=ratio(pd.itl_s["p50"], colo.itl_s["p50"]),
        itl_p99=ratio(pd.itl_s["p99"], colo.itl_s["p99"]),
        output_tok_s=ratio(pd.output_tok_s, colo.output_tok_s),
    )


def config(
    args: argparse.Namespace, note: str | None, cores: tuple[Any, Any, Any]
) -> dict[str, Any]:
    return dict(
        num_requests=args.num_requests,
        rate=args.rate,
        seed=args.seed,
        max_tokens=args.max_tokens,
        long_fraction=args.long_fraction,
        long_len=list(args.long_len),
        short_len=list(args.short_len),
        backend=args.backend,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        cpu_count=os.cpu_count(),
        pinning=dict(colocated=cores[0], prefill=cores[1], decode=cores[2], proxy=None, note=note),
        bandwidth_mib=args.bandwidth_mib,
        kill_test=args.kill_test,
        kill_rate=args.kill_rate,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    stop_on_sigterm()
    # NIXL logs INFO lines to stdout (its own handler): keep stdout table + JSON (inherited by
    # the spawned bandwidth agent).
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    check_args(args)
    colo_cores, p_cores, d_cores, note = pinning()
    logs = Path(tempfile.mkdtemp(prefix="bench_disagg-"))
    reqs = make_workload(args, args.num_requests, args.rate, args.seed)
    report: dict[str, Any] = dict(config=config(args, note, (colo_cores, p_cores, d_cores)))
    parts = {"serving", "bandwidth", "kill"} if args.only == "all" else {args.only}
    report.update(colocated=None, pd=None, ratios=None, bandwidth=None, kill_test=None)
    try:
        rat = bw = kill = None
        if "serving" in parts:
            colo = run_colocated(args, logs, reqs, colo_cores)
            pd = run_pd(args, logs, reqs, p_cores, d_cores)
            rat = ratios(pd, colo)
            report.update(colocated=asdict(colo), pd=asdict(pd), ratios=rat)
        if "bandwidth" in parts:
            log(args, "transfer bandwidth ...")
            bw = run_bandwidth(args)
            report["bandwidth"] = asdict(bw)
        if "kill" in parts and args.kill_test:
            kill = run_kill_test(args, logs)
            report["kill_test"] = asdict(kill)
        report["targets"] = dict(
            itl_p99_ratio=TARGET_ITL_P99_RATIO,
            bandwidth_ratio=TARGET_BANDWIDTH_RATIO,
            kill_test_lost=0,
        )
        report["meets_targets"] = dict(
            itl_p99=None
            if rat is None
            else rat["itl_p99"] is not None and rat["itl_p99"] <= TARGET_ITL_P99_RATIO,
            bandwidth=None if bw is None else bw.ratio_vs_memcpy >= TARGET_BANDWIDTH_RATIO,
            kill_test=None if kill is None else kill.lost == 0,
        )
    finally:
        if args.keep_logs:
            log(args, f"logs kept in {logs}")
        else:
            shutil.rmtree(logs, ignore_errors=True)
    return report


def table(report: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None or math.isnan(x) else f"{1000 * x:.1f}"

    c = report["config"]
    pin = c["pinning"]
    lines = [
        f"bench_disagg: {c['num_requests']} requests at {c['rate']:g} req/s, {c['max_tokens']} output tokens, "
        f"{c['long_fraction']:.0%} long prompts ({c['long_len'][0]}-{c['long_len'][1]} tokens), "
        f"backend {c['backend']}, {c['cpu_count']} CPUs",
        f"pinning: colocated {pin['colocated']}, prefill {pin['prefill']}, decode {pin['decode']}"
        + (f" ({pin['note']})" if pin["note"] else ""),
        "",
        f"{'setup':<10} {'ok':>4} {'failed':>6} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8}  (latencies in ms)",
    ]
    met = report["meets_targets"]
    for key in ("colocated", "pd") if report["pd"] is not None else ():
        r = report[key]
        lines.append(
            f"{key:<10} {r['completed']:>4} {r['failed']:>6} {r['output_tok_s']:>9.1f} "
            f"{ms(r['ttft_s']['p50']):>9} {ms(r['ttft_s']['p99']):>9} {ms(r['itl_s']['p50']):>8} "
            f"{ms(r['itl_s']['p99']):>8}"
        )
    rat = report["ratios"]
    if rat is not None:
        lines.append(
            f"{'PD/colo':<10} {'':>4} {'':>6} "
            + " ".join(
                f"{'-' if rat[k] is None else format(rat[k], '.2f'):>{w}}"
                for k, w in (
                    ("output_tok_s", 9),
                    ("ttft_p50", 9),
                    ("ttft_p99", 9),
                    ("itl_p50", 8),
                    ("itl_p99", 8),
                )
            )
        )
        lines.append(
            f"PD KV transfers: {report['pd']['kv_transfers']}, failures: {report['pd']['kv_transfer_failures']}"
        )
        lines.append(
            f"ITL p99 PD/colocated <= {TARGET_ITL_P99_RATIO}: {'met' if met['itl_p99'] else 'NOT met'}"
        )
    bw = report["bandwidth"]
    if bw is not None:
        lines += [
            "",
            f"transfer ({bw['backend']}, {bw['agents']}): {bw['bytes_moved'] / 2**20:.1f} MiB in "
            f"{bw['blocks']} blocks: {bw['transfer_gbps']:.2f} GB/s; memcpy {bw['memcpy_gbps']:.2f} GB/s "
            f"(ratio {bw['ratio_vs_memcpy']:.2f}, target >= {TARGET_BANDWIDTH_RATIO}: "
            f"{'met' if met['bandwidth'] else 'NOT met'}); index_copy {bw['index_copy_gbps']:.2f} GB/s "
            f"(ratio {bw['ratio_vs_index_copy']:.2f}); verified: {bw['verified']}",
        ]
    kill = report["kill_test"]
    if kill is not None:
        lines += [
            "",
            f"kill test: {kill['requests']} requests, {kill['lost']} lost, {len(kill['kills'])} kills "
            f"({', '.join(k['instance'] for k in kill['kills']) or 'none'}) in {kill['duration_s']:.1f} s",
        ]
        pin = kill.get("pinning")  # absent from reports written before instances were pinned
        if pin:
            lines.append(
                f"  instances pinned to CPUs {pin['cores']}"
                + (f" ({pin['note']})" if pin["note"] else "")
            )
        restarts = sorted(k["restart_s"] for k in kill["kills"] if k["restart_s"] is not None)
        if restarts:
            lines.append(
                f"  restarts {restarts[0]:.1f}-{restarts[-1]:.1f} s (median {restarts[len(restarts) // 2]:.1f} s)"
            )
        lines += [f"  lost {n}: {kind}" for kind, n in kill["error_counts"].items()]
    return "\n".join(lines)


# ---- options -------------------------------------------------------------------------------------


def default_backend() -> str:
    from pagedkv.transfer import nixl_import_error

    return "nixl" if nixl_import_error() is None else "tcp"


def seconds_range(text: str) -> tuple[float, float]:
    try:
        lo, _, hi = text.partition(":")
        a, b = float(lo), float(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid range {text!r}: use MIN:MAX or S") from None
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"invalid range {text!r}: need 0 < MIN <= MAX")
    return a, b


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=32, help="requests per setup (default 32)")
    p.add_argument(
        "--rate", type=positive_float, default=2.0, help="Poisson arrival rate, req/s (default 2)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--max-tokens", type=int, default=32, help="output tokens per request (default 32)"
    )
    p.add_argument(
        "--long-fraction", type=float, default=0.5, help="share of long prompts (default 0.5)"
    )
    p.add_argument(
        "--long-len",
        type=int_range,
        default=(400, 800),
        help="long prompt tokens MIN:MAX (400:800)",
    )
    p.add_argument(
        "--short-len", type=int_range, default=(8, 32), help="short prompt tokens MIN:MAX (8:32)"
    )
    p.add_argument(
        "--backend",
        choices=["nixl", "tcp"],
        default=None,
        help="KV transfer backend (default: nixl when it imports, else tcp)",
    )
    g = p.add_argument_group("engine (every instance)")
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=384,
        help="KV pool per instance in blocks (default 384)",
    )
    g.add_argument(
        "--max-model-len", type=int, default=1024, help="context length cap (default 1024)"
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=16, help="max running sequences (default 16)"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=1024,
        help="token budget per step (default 1024)",
    )
    g = p.add_argument_group("bandwidth and kill test")
    g.add_argument(
        "--bandwidth-mib",
        type=positive_float,
        default=64.0,
        help="MiB of blocks to move (default 64)",
    )
    g.add_argument(
        "--bandwidth-repeats", type=int, default=5, help="timed transfers / copies (default 5)"
    )
    g.add_argument(
        "--kv-layout",
        default="LBNHC",
        help="KV buffer layout of the bandwidth test (default LBNHC, the engine's default; "
        "BLNHC makes each block one contiguous range across layers)",
    )
    g.add_argument(
        "--kill-test",
        type=int,
        default=20,
        metavar="N",
        help="kill-test requests; 0 skips (default 20)",
    )
    g.add_argument(
        "--kill-rate",
        type=positive_float,
        default=1.0,
        help="kill-test arrival rate, req/s (default 1)",
    )
    g.add_argument(
        "--kill-interval",
        type=seconds_range,
        default=(2.0, 5.0),
        help="seconds between a restart and the next kill, MIN:MAX (default 2:5)",
    )
    p.add_argument(
        "--only",
        choices=["all", "serving", "bandwidth", "kill"],
        default="all",
        help="run one part only (default all)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the instances' log files")
    add_output_args(p)


def check_args(args: argparse.Namespace) -> None:
    """BenchOptionError for inconsistent options; resolves ``--backend``."""
    if (
        args.num_requests < 1
        or args.max_tokens < 1
        or args.bandwidth_repeats < 1
        or args.kill_test < 0
    ):
        raise BenchOptionError(
            "--num-requests, --max-tokens and --bandwidth-repeats must be >= 1, --kill-test >= 0"
        )
    if not 0 <= args.long_fraction <= 1:
        raise BenchOptionError("--long-fraction must be in [0, 1]")
    if max(args.long_len[1], args.short_len[1]) + args.max_tokens > args.max_model_len:
        raise BenchOptionError("the longest prompt + --max-tokens must fit in --max-model-len")
    if args.backend is None:
        args.backend = default_backend()
    elif args.backend == "nixl" and default_backend() != "nixl":
        raise BenchOptionError("--backend nixl: NIXL does not import here")


def exit_code(report: dict[str, Any]) -> int:
    """1 when a serving request failed or the kill test lost one (the report is still printed)."""
    kill = report.get("kill_test")
    failed = any(report[k] is not None and report[k]["failed"] for k in ("colocated", "pd"))
    return 1 if failed or (kill and kill["lost"]) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench_disagg",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return run_and_emit(run, table, p.parse_args(argv), exit_code)
