"""The server's periodic stats line (vLLM's ``LoggingStatLogger``), and the server-side wiring
of its observability options (`configure_server_stats`).

Every ``interval_s`` seconds (``pagedkv serve --log-stats-interval``, 10 by default) while the
server is busy, one line at INFO level::

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 231.0 tokens/s,
    Running: 12 reqs, Waiting: 3 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 63.5%

(one line in the log). Throughputs and the hit rate cover the last interval: prompt tokens
count when a request's prefill ends (its first token), as in vLLM; the hit rate is the prefix
cache's hits over its queries in the interval (in tokens), or the cumulative rate when the
interval had no query. Running, waiting and usage are the engine's latest snapshot. An idle
server (no tokens in this interval or the previous one, nothing running or waiting) logs at
DEBUG only, so a quiet server's log stays quiet.

`LoggingStatLogger.record_step` runs on the engine thread (the `StatLogger` protocol of
`AsyncLLM`); the line is written by a daemon thread of its own, so a step never waits on
logging and an interval ends on time even when no step ends it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pagedkv.entrypoints.metrics import DEFAULT_METRICS_PREFIX

if TYPE_CHECKING:
    from pagedkv.engine.async_llm import AsyncLLM
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.outputs import RequestOutput
    from pagedkv.engine.stats import SchedulerStats

logger = logging.getLogger(__name__)

DEFAULT_LOG_STATS_INTERVAL_S = 10.0


class LoggingStatLogger:
    """Logs vLLM's stats line every ``interval_s`` seconds while the engine is busy."""

    def __init__(
        self, async_llm: AsyncLLM, interval_s: float = DEFAULT_LOG_STATS_INTERVAL_S
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"invalid log stats interval {interval_s!r}: must be > 0 seconds")
        self.async_llm = async_llm
        self.interval_s = float(interval_s)
        self._lock = threading.Lock()
        self._started: set[str] = set()  # requests whose first token was seen
        self._prompt_tokens = 0  # prompt tokens of prefills that ended in this interval
        self._last_time = time.monotonic()
        self._last_snapshot = self._snapshot()
        self._last_busy = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lines_logged = 0

    # ---- engine thread (StatLogger protocol) -------------------------------------------------

    def record_step(self, engine: LLMEngine, outputs: list[RequestOutput], now: float) -> None:
        """Count the prompt tokens of requests whose first token arrived in this step."""
        with self._lock:
            for out in outputs:
                rid = out.request_id
                if rid not in self._started and any(c.token_ids for c in out.outputs):
                    self._started.add(rid)
                    self._prompt_tokens += len(out.prompt_token_ids)
                if out.finished:
                    self._started.discard(rid)

    def record_abort(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._started.difference_update(request_ids)

    # ---- the line --------------------------------------------------------------------------------

    def _snapshot(self) -> SchedulerStats:
        """The engine's latest snapshot; `AsyncLLM` replaces it, never mutates it, so keeping a
        reference keeps the numbers this interval started from."""
        return self.async_llm.last_stats

    def log(self, now: float | None = None) -> str:
        """Close the current interval: build its line, log it (INFO when busy, else DEBUG)
        and return it."""
        now = time.monotonic() if now is None else now
        snap = self._snapshot()
        with self._lock:
            prompt_tokens, self._prompt_tokens = self._prompt_tokens, 0
            elapsed = max(now - self._last_time, 1e-9)
            prev, self._last_snapshot, self._last_time = self._last_snapshot, snap, now
        gen_tokens = max(snap.generation_tokens - prev.generation_tokens, 0)
        pc, prev_pc = snap.prefix_cache_stats, prev.prefix_cache_stats
        queries, hits = pc.queries - prev_pc.queries, pc.hits - prev_pc.hits
        hit_rate = hits / queries if queries > 0 else pc.hit_rate
        running, waiting = snap.num_running_reqs, snap.num_waiting_reqs
        line = (
            f"Avg prompt throughput: {prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {gen_tokens / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * snap.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%"
        )
        busy = bool(prompt_tokens or gen_tokens or running or waiting)
        # As vLLM: the first idle interval after a busy one still shows (its throughput is 0).
        level = logging.INFO if busy or self._last_busy else logging.DEBUG
        self._last_busy = busy
        logger.log(level, "%s", line)
        if level == logging.INFO:
            self.lines_logged += 1
        return line

    # ---- the logging thread -------------------------------------------------------------------

    def start(self) -> LoggingStatLogger:
        """Start the daemon thread; it stops with `stop` or once the engine is down."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="pagedkv-stat-logger", daemon=True
            )
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.async_llm.is_healthy:
                return
            try:
                self.log()
            except Exception:  # never let a stats bug take the thread down silently twice
                logger.exception("stats logging failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def configure_server_stats(
    state: Any,
    metrics_prefix: str = DEFAULT_METRICS_PREFIX,
    log_stats_interval: float = DEFAULT_LOG_STATS_INTERVAL_S,
) -> LoggingStatLogger | None:
    """Apply ``serve``'s observability flags to a built app's state (``app.state.pagedkv``):
    the metrics prefix, and the stats line every ``log_stats_interval`` seconds (0: none).
    Call before serving traffic. Returns the stat logger (started), if any. Raises ValueError
    naming a bad value."""
    if log_stats_interval < 0:
        raise ValueError(
            f"invalid --log-stats-interval {log_stats_interval}: must be >= 0 (0 turns it off)"
        )
    if metrics_prefix != state.metrics.prefix.rstrip(":"):
        state.metrics.use_prefix(metrics_prefix)
    if not log_stats_interval:
        return None
    llm = state.async_llm
    stat_logger = LoggingStatLogger(llm, log_stats_interval)
    # The engine thread iterates stat_loggers: change the list on that thread.
    llm.call_in_engine(lambda _engine: llm.stat_loggers.append(stat_logger)).result(30)
    if (
        logger.getEffectiveLevel() > logging.INFO
        and logging.getLogger().getEffectiveLevel() <= logging.WARNING
    ):
        # The line is what an operator watches: shown at the default --log-level warning too.
        logger.setLevel(logging.INFO)
    state.stat_logger = stat_logger
    return stat_logger.start()
