"""``pagedkv simulate calibrate``: fit the simulator's `CostModel` to the real engine here.

Runs the real `LLMEngine` (the only module of `pagedkv.sim` that imports torch, lazily) on a
few workloads — single prompts of several lengths (prefill steps), batches of short prompts
decoding (decode steps at several batch sizes), a batch of long prompts decoding (context) —
and times every engine step together with its batch shape (prefill tokens, decoding sequences,
context tokens, read from the `SchedulerOutput`). A least-squares fit of
``step_s = base + a*P + b*D + c*C`` (coefficients clipped at 0 and refit) gives the model; the
JSON holds it, the fit's error and the raw steps.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.sim.cost import CostModel


@dataclass(slots=True)
class StepSample:
    prefill_tokens: int
    decode_seqs: int
    context_tokens: int
    seconds: float


def _shape(so: Any) -> tuple[int, int, int]:
    prefill = decode = ctx = 0
    for s in so.scheduled:  # read at schedule time: the step appends tokens to the requests
        req, n = s.request, s.num_tokens
        ctx += s.start + n
        if n == 1 and req.output_token_ids and s.start == req.num_tokens - 1:
            decode += 1
        else:
            prefill += n
    return prefill, decode, ctx


def measure(
    engine_kwargs: dict[str, Any],
    prompt_lens: tuple[int, ...] = (32, 128, 512, 1024),
    batch_sizes: tuple[int, ...] = (1, 4, 16),
    decode_tokens: int = 24,
    long_context: int = 768,
    seed: int = 0,
) -> tuple[list[StepSample], dict[str, Any]]:
    """Run the workloads on a real engine; returns the step samples and engine facts."""
    import random

    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(**engine_kwargs))
    sched = engine.scheduler
    samples: list[StepSample] = []
    last: list[Any] = []
    inner = sched.schedule

    def recording_schedule() -> Any:  # the step's batch shape, for the timing below
        so = inner()
        if so.scheduled:
            last.append(_shape(so))
        return so

    sched.schedule = recording_schedule  # type: ignore[method-assign]
    rng = random.Random(seed)
    ids = iter(range(1 << 30))

    def prompt(n: int) -> dict[str, list[int]]:
        return {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(n)]}

    def run(prompts: list[dict], max_tokens: int, record: bool = True) -> None:
        for p in prompts:
            engine.add_request(
                f"cal-{next(ids)}",
                p,
                SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
            )
        while engine.has_unfinished_requests():
            last.clear()
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if record and last:
                p, d, c = last[-1]
                samples.append(StepSample(p, d, c, dt))

    run([prompt(64)], 4, record=False)  # warm-up
    for n in prompt_lens:
        for _ in range(2):
            run([prompt(n)], 1)
    for b in batch_sizes:
        run([prompt(48) for _ in range(b)], decode_tokens)
    run([prompt(long_context) for _ in range(4)], decode_tokens // 2)
    cfg = engine.kv_cache_config
    facts = {
        "block_size": engine.config.block_size,
        "bytes_per_block": cfg.bytes_per_block,
        "num_blocks": cfg.num_blocks,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
    }
    engine.shutdown()
    return samples, facts


def fit(samples: list[StepSample]) -> tuple[list[float], float]:
    """Nonnegative least squares by clipping: ``[base, prefill_token, decode_seq, context_token]``
    and the mean relative error of the fit."""
    import numpy as np

    X = np.array([[1.0, s.prefill_tokens, s.decode_seqs, s.context_tokens] for s in samples])
    y = np.array([s.seconds for s in samples])
    w = 1.0 / np.maximum(y, 1e-4)  # relative error: short decode steps count as much as prefills
    active = [0, 1, 2, 3]
    coef = np.zeros(4)
    while True:
        sol, *_ = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            coef[:] = 0
            coef[active] = np.maximum(sol, 0)
            break
        active = [a for a, v in zip(active, sol) if v >= 0]
    pred = X @ coef
    err = float(np.mean(np.abs(pred - y) / y))
    return [float(c) for c in coef], err


def calibrate(
    engine_kwargs: dict[str, Any], out: str | Path | None = None, name: str = "calibrated"
) -> dict:
    t0 = time.perf_counter()
    samples, facts = measure(engine_kwargs)
    coef, err = fit(samples)
    model = CostModel(
        name=name,
        base_s=coef[0],
        prefill_token_s=coef[1],
        decode_seq_s=coef[2],
        context_token_s=coef[3],
        block_size=facts["block_size"],
        block_bytes=facts["bytes_per_block"],
        host_bw_bytes_s=20e9,
        source=f"pagedkv simulate calibrate on this machine ({engine_kwargs})",
    )
    report = {
        "cost_model": model.to_json(),
        "fit_mean_relative_error": err,
        "num_steps": len(samples),
        "engine": facts,
        "wall_s": time.perf_counter() - t0,
        "steps": [
            [s.prefill_tokens, s.decode_seqs, s.context_tokens, round(s.seconds, 6)]
            for s in samples
        ],
    }
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report


# ---- through a real server ---------------------------------------------------------------------


def _stream_times(url: str, model: str, tokens: list[int], max_tokens: int) -> list[float]:
    """Arrival times (perf_counter) of the streamed chunks of one completion."""
    import httpx

    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    times: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.perf_counter())
    return times


def measure_server(
    serve_flags: list[str],
    threads: int = 1,
    prompt_lens: tuple[int, ...] = (32, 128, 256, 512),
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16),
    decode_tokens: int = 24,
    seed: int = 0,
) -> tuple[list[tuple[list[float], float]], dict[str, Any]]:
    """Start ``pagedkv serve`` (``OMP_NUM_THREADS=threads``), then measure as a client: the TTFT
    of single requests (idle server) and the inter-chunk gaps of ``B`` concurrent streams
    (decode steps). Returns fit rows ``([overhead, base, P, D, C], seconds)`` and facts."""
    import os
    import random
    import socket
    import statistics
    import subprocess
    import sys
    import threading

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "pagedkv.entrypoints.cli",
        "serve",
        "--port",
        str(port),
        "--log-stats-interval",
        "0",
        *serve_flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    rows: list[tuple[list[float], float]] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"pagedkv serve did not start (rc={proc.poll()}): {' '.join(cmd)}"
                )
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        info = httpx.get(url + "/v1/kv_cache_config", timeout=10).json()
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        rng = random.Random(seed)

        def prompt(n: int) -> list[int]:
            return [rng.randrange(1000, 40000) for _ in range(n)]

        for _ in range(2):  # warm-up
            _stream_times(url, model, prompt(64), 4)
        for n in prompt_lens:
            for _ in range(2):
                t = time.perf_counter()
                first = _stream_times(url, model, prompt(n), 1)[0]
                rows.append(([1.0, 1.0, n, 0.0, n], first - t))
        for b, plen in [(b, 48) for b in batch_sizes] + [(4, 384)]:
            prompts = [prompt(plen) for _ in range(b)]
            results: list[list[float]] = [[] for _ in range(b)]

            def go(i: int) -> None:
                results[i] = _stream_times(url, model, prompts[i], decode_tokens)

            threads_ = [threading.Thread(target=go, args=(i,)) for i in range(b)]
            for th in threads_:
                th.start()
            for th in threads_:
                th.join()
            # Gaps once every stream decodes: after the last stream's first chunk.
            start = max(r[0] for r in results)
            gaps = [y - x for r in results for x, y in zip(r, r[1:]) if x >= start]
            if gaps:
                # one gap per step per stream: the median is the step time of a b-sequence batch
                ctx = b * (plen + decode_tokens // 2)
                rows.append(([0.0, 1.0, 0.0, b, ctx], statistics.median(gaps)))
        facts = {
            "block_size": info.get("block_size", 16),
            "bytes_per_block": info.get("bytes_per_block", 0),
            "num_blocks": info.get("num_blocks"),
            "threads": threads,
            "serve_flags": serve_flags,
        }
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    return rows, facts


def fit_rows(rows: list[tuple[list[float], float]]) -> tuple[list[float], float]:
    """Nonnegative least squares (by clipping) of ``y = x . coef``, relative-error weighted."""
    import numpy as np

    X = np.array([r[0] for r in rows], dtype=float)
    y = np.array([r[1] for r in rows], dtype=float)
    w = 1.0 / np.maximum(y, 1e-4)
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while True:
        sol, *_ = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            coef[active] = np.maximum(sol, 0)
            break
        active = [a for a, v in zip(active, sol) if v >= 0]
    err = float(np.mean(np.abs(X @ coef - y) / y))
    return [float(c) for c in coef], err


def calibrate_server(
    serve_flags: list[str],
    threads: int = 1,
    out: str | Path | None = None,
    name: str = "calibrated-server",
) -> dict:
    """Fit a `CostModel` (with ``request_overhead_s``) to a real ``pagedkv serve`` process."""
    t0 = time.perf_counter()
    rows, facts = measure_server(serve_flags, threads)
    coef, err = fit_rows(rows)
    model = CostModel(
        name=name,
        base_s=coef[1],
        prefill_token_s=coef[2],
        decode_seq_s=coef[3],
        context_token_s=coef[4],
        block_size=facts["block_size"],
        block_bytes=facts["bytes_per_block"],
        host_bw_bytes_s=20e9,
        request_overhead_s=coef[0],
        source=f"pagedkv simulate calibrate --server on this machine ({' '.join(serve_flags)}, "
        f"OMP_NUM_THREADS={threads})",
    )
    report = {
        "cost_model": model.to_json(),
        "fit_mean_relative_error": err,
        "num_steps": len(rows),
        "engine": facts,
        "wall_s": time.perf_counter() - t0,
        "rows": [[*r[0], round(r[1], 6)] for r in rows],
    }
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report
