"""Validate `pagedkv simulate` against a real 3-replica fleet on the same trace.

1. Calibrate the cost model on this machine (`pagedkv.sim.calibrate.calibrate_server`: one real
   ``pagedkv serve`` with one torch thread, as each replica below), or load ``--cost``.
2. Generate a small multi-turn chat trace (shared system prompts, sessions of a few turns).
3. Real fleet: 3 ``pagedkv serve`` processes (SmolLM2, ``--num-kv-blocks`` small so LRU eviction
   matters, ``OMP_NUM_THREADS=1``) on 127.0.0.1; the client replays the trace at its arrival
   times, routing with `pagedkv.router.scoring.RoutingPolicy` (round-robin: the same replica
   per request as the simulator; kv: fed from the replicas' ZMQ KV events into a
   `pagedkv.router.index.PrefixIndex`), streaming completions of the trace's token ids with
   ``ignore_eos`` so output lengths match. TTFT = first streamed chunk - scheduled arrival;
   prefix hit rate = the servers' ``prefix_cache_hits / prefix_cache_queries`` (diff of
   /metrics before and after).
4. Simulator: the same trace, fleet shape and policy, engine hashes (``hash_mode="real"``),
   output blocks unmatched (the model's answers are not the trace's replies), the cost model
   calibrated through one real server (``calibrate_server``: step costs plus the per-request
   serving overhead), and the replicas sharing this host's cores (``host_cores``).

Prints JSON and a table: hit rate and TTFT p50 both ways and their differences. Every process
started is stopped by PID, also on failure.

    .venv/bin/python benchmarks/bench_sim_validate.py            # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pagedkv.bench.instances import free_port
from pagedkv.router.index import PrefixIndex
from pagedkv.router.scoring import ReplicaLoad, RoutingPolicy
from pagedkv.sim.cost import CostModel
from pagedkv.sim.fleet import FleetConfig, simulate
from pagedkv.sim.hashes import PrefixHasher
from pagedkv.sim.replica import ReplicaConfig
from pagedkv.sim.report import summarize
from pagedkv.sim.trace import TraceRequest, gen_chat

ROOT = Path(__file__).resolve().parent.parent


class Server:
    """One ``pagedkv serve`` process (one torch thread); stopped by PID."""

    def __init__(self, name: str, args: argparse.Namespace, log_dir: Path, events: bool) -> None:
        self.name = name
        self.port = free_port()
        self.events_endpoint = f"tcp://127.0.0.1:{free_port()}" if events else None
        cmd = [
            sys.executable,
            "-m",
            "pagedkv.entrypoints.cli",
            "serve",
            "--port",
            str(self.port),
            "--num-kv-blocks",
            str(args.num_blocks),
            "--max-model-len",
            str(args.max_model_len),
            "--max-queue-size",
            "1024",
            "--log-stats-interval",
            "0",
        ]
        if events:
            cmd += ["--enable-kv-cache-events", "--kv-events-endpoint", self.events_endpoint]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.log = log_dir / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(
            f"{self.name} not ready:\n{self.log.read_text(errors='replace')[-2000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text

    def val(name: str) -> float:
        m = re.search(rf"^pagedkv:{name}_total(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return val("prefix_cache_queries"), val("prefix_cache_hits")


class EventFeed:
    """Subscribes to every replica's KV events and applies them to one `PrefixIndex`."""

    def __init__(self, servers: list[Server]) -> None:
        from pagedkv.core.event_transport import KVEventSubscriber

        self.index = PrefixIndex()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.subs = [(s.name, KVEventSubscriber(s.events_endpoint)) for s in servers]
        self.threads = [
            threading.Thread(target=self._pump, args=(n, sub), daemon=True) for n, sub in self.subs
        ]
        for t in self.threads:
            t.start()

    def _pump(self, name: str, sub) -> None:
        while not self.stop.is_set():
            got = sub.recv(timeout=0.2)
            if got is not None:
                with self.lock:
                    self.index.apply_batch(name, got[1].events)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(2)
        for _, sub in self.subs:
            sub.close()


async def replay(
    trace: list[TraceRequest],
    servers: list[Server],
    policy: str,
    model: str,
    feed: EventFeed | None,
    block_size: int,
) -> list[dict]:
    """Send every request at its arrival time; returns per-request TTFT/e2e and replica."""
    router = RoutingPolicy(policy)
    names = [s.name for s in servers]
    by_name = {s.name: s for s in servers}
    inflight = {n: 0 for n in names}
    hasher = PrefixHasher(block_size, "real")
    results: list[dict] = []
    t0 = time.perf_counter() + 0.5

    async def one(client: httpx.AsyncClient, req: TraceRequest) -> None:
        await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
        from pagedkv.router.hashing import to_external

        ext = [to_external(h) for h in hasher.hashes(req)]
        matches = {}
        if feed is not None:
            with feed.lock:
                matches = feed.index.match(ext)
        loads = {n: ReplicaLoad(num_running=inflight[n]) for n in names}
        d = router.choose(names, len(ext), matches, loads, block_size)
        inflight[d.replica] += 1
        body = {
            "model": model,
            "prompt": req.token_ids(),
            "max_tokens": req.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
        start = t0 + req.arrival
        first = None
        async with client.stream(
            "POST", by_name[d.replica].url + "/v1/completions", json=body
        ) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data:") and first is None and "[DONE]" not in line:
                    first = time.perf_counter()
        end = time.perf_counter()
        inflight[d.replica] -= 1
        results.append(
            {"id": req.request_id, "replica": d.replica, "ttft": first - start, "e2e": end - start}
        )

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, r) for r in trace))
    return results


def run_real(trace: list[TraceRequest], args: argparse.Namespace, policy: str) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="sim_validate_"))
    servers: list[Server] = []
    feed = None
    try:
        for i in range(args.replicas):
            servers.append(Server(f"r{i}", args, log_dir, events=policy == "kv"))
        for s in servers:
            s.wait_ready()
        model = httpx.get(servers[0].url + "/v1/models", timeout=10).json()["data"][0]["id"]
        feed = EventFeed(servers) if policy == "kv" else None
        time.sleep(0.5)  # subscribers connected before the first event
        before = [prefix_counters(s.url) for s in servers]
        t = time.perf_counter()
        results = asyncio.run(replay(trace, servers, policy, model, feed, 16))
        wall = time.perf_counter() - t
        after = [prefix_counters(s.url) for s in servers]
    finally:
        if feed is not None:
            feed.close()
        for s in servers:
            s.stop()
    q = sum(a[0] - b[0] for a, b in zip(after, before))
    h = sum(a[1] - b[1] for a, b in zip(after, before))
    return {
        "hit_rate": h / q if q else 0.0,
        "queries_tokens": q,
        "hit_tokens": h,
        "ttft": summarize([r["ttft"] for r in results]),
        "e2e": summarize([r["e2e"] for r in results]),
        "wall_s": wall,
        "per_replica": {
            n: sum(r["replica"] == n for r in results) for n in (s.name for s in servers)
        },
    }


def run_sim(
    trace: list[TraceRequest], args: argparse.Namespace, cost: CostModel, policy: str
) -> dict:
    rc = ReplicaConfig(num_blocks=args.num_blocks, block_size=16, max_model_len=args.max_model_len)
    rep = simulate(
        trace,
        FleetConfig(
            replicas=args.replicas,
            replica=rc,
            policy=policy,
            hash_mode="real",
            reply_hashes=False,
            host_cores=args.host_cores,
        ),
        cost,
    )
    return {
        "hit_rate": rep["hit_rate"]["device"],
        "queries_tokens": rep["hit_rate"]["queries_tokens"],
        "hit_tokens": rep["hit_rate"]["device_hit_tokens"],
        "ttft": rep["latency_s"]["ttft"],
        "e2e": rep["latency_s"]["e2e"],
        "wall_s": rep["perf"]["wall_s"],
        "preemptions": rep["preemptions"],
        "per_replica": rep["per_replica_requests"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cost", default=None, help="a calibration JSON (default: calibrate now)")
    ap.add_argument("--policies", default="round-robin,kv")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=36)
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--num-blocks", type=int, default=96, help="KV blocks per replica")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--host-cores",
        type=int,
        default=os.cpu_count() or 1,
        help="cores the real replicas share (the simulator models the sharing; 0: off)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_validate.json"))
    args = ap.parse_args()

    def cost_model() -> CostModel:
        if args.cost:
            return CostModel.load(args.cost)
        # The replicas' own serving path, one torch thread, measured as a client sees it, right
        # before the fleet runs (this machine is shared: its load drifts).
        from pagedkv.sim.calibrate import calibrate_server

        path = ROOT / "benchmarks/results/sim_cost_cpu_server.json"
        cal = calibrate_server(
            ["--num-kv-blocks", "512", "--max-model-len", "2048"],
            threads=1,
            out=path,
            name="cpu-smollm2-serve-1thread",
        )
        print(
            f"calibrated in {cal['wall_s']:.0f}s (fit error {cal['fit_mean_relative_error'] * 100:.1f}%)",
            flush=True,
        )
        return CostModel.load(path)

    trace = gen_chat(
        args.num_requests,
        args.rate,
        args.seed,
        num_system_prompts=3,
        system_len=200,
        turns=3,
        user_len=32,
        output_len=16,
        think_time=6.0,
    )
    out: dict = {
        "trace": {
            "requests": len(trace),
            "generator": "chat",
            "rate": args.rate,
            "prompt_tokens": sum(r.prompt_len for r in trace),
        },
        "fleet": {
            "replicas": args.replicas,
            "num_blocks": args.num_blocks,
            "host_cores": args.host_cores,
        },
        "policies": {},
    }
    for policy in args.policies.split(","):
        cost = cost_model()
        load_before = os.getloadavg()[0]
        real = run_real(trace, args, policy)
        real["loadavg_1min"] = [load_before, os.getloadavg()[0]]
        sim = run_sim(trace, args, cost, policy)
        sim["cost_model"] = cost.to_json()
        diff = {
            "hit_rate_pp": (sim["hit_rate"] - real["hit_rate"]) * 100,
            "ttft_p50_rel": sim["ttft"]["p50"] / real["ttft"]["p50"] - 1
            if real["ttft"]["p50"]
            else None,
        }
        out["policies"][policy] = {
            "real": real,
            "sim": sim,
            "diff": diff,
            "pass": abs(diff["hit_rate_pp"]) <= 2 and abs(diff["ttft_p50_rel"] or 9) <= 0.25,
        }
        print(f"{policy}: done", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["policies"], indent=1))
    print(f"\n{'policy':12}{'':6}{'hit rate':>10}{'TTFT p50':>11}{'TTFT p99':>11}")
    for policy, r in out["policies"].items():
        for side in ("real", "sim"):
            x = r[side]
            print(
                f"{policy:12}{side:6}{x['hit_rate']:>10.3f}{x['ttft']['p50'] * 1000:>9.0f}ms"
                f"{x['ttft']['p99'] * 1000:>9.0f}ms"
            )
        d = r["diff"]
        print(
            f"{policy:12}{'diff':6}{d['hit_rate_pp']:>+9.2f}pp{(d['ttft_p50_rel'] or 0) * 100:>+9.0f}% "
            f"  {'PASS' if r['pass'] else 'FAIL'} (|hit| <= 2pp, |TTFT p50| <= 25%); "
            f"load average during the real run {r['real']['loadavg_1min'][0]:.1f} -> "
            f"{r['real']['loadavg_1min'][1]:.1f} on {os.cpu_count()} cores"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
