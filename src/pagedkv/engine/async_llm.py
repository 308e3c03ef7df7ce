"""`AsyncLLM`: the synchronous `LLMEngine` driven by one background thread, for asyncio servers.

One thread (``pagedkv-engine``) owns the engine: it alone calls ``add_request``, ``step`` and
``abort_request``, so the engine needs no lock. Given an `EngineConfig` it also *builds* the
engine (``AsyncLLM(config=...)``): on CPU, a model built on one thread and stepped on another
ran 10-20% slower (torch's OpenMP pool and kernel caches are per thread). Other threads talk to
it through a command list (a condition variable wakes the thread when it is idle):

* `add_request` (a coroutine) submits the request and waits until the engine thread has
  queued it, so a ValueError from the engine (prompt too long, bad token ids) reaches the
  caller before any response is sent; it returns a `RequestStream` to iterate;
* `abort` is fire-and-forget and callable from any thread (a client disconnect, a cancelled
  task); the request's blocks are freed before the next step;
* `run_in_engine(fn)` runs ``fn(engine)`` on the engine thread between two steps and returns
  its result: a consistent view of the block pool (dashboard), a prefix-cache reset, invariants.

After every step the thread hands each request's latest `RequestOutput` to its stream (one
``call_soon_threadsafe`` per event loop per step). Outputs are cumulative snapshots, so a slow
consumer only sees the newest one: a stream never grows without bound. KV events are drained
after every step (and command) and given to ``event_publisher``; per-step stats go to
``stat_loggers``, and ``last_stats`` holds the engine's latest `SchedulerStats` snapshot.

Admission control: at most ``max_num_seqs + max_queue_size`` user requests may be in flight
(those beyond ``max_num_seqs`` wait in the scheduler's queue); `add_request` raises
`QueueFullError` beyond that (an HTTP server answers 503 with ``Retry-After``).

Prompts are tokenized and validated (`LLMEngine.process_prompt`) in `add_request`, long ones on
a small thread pool, so the engine thread only receives token ids: a multi-megabyte prompt
neither stalls the running streams nor reaches the engine. A structured request's grammar is
compiled there too (`StructuredOutputManager.compile`, cached).

Failures: when running a batch raises (forward pass, sampler...), `LLMEngine.step` finishes
the requests of that batch with an error and goes on; their streams raise
`EngineGenerateError`, every other request keeps going and ``is_healthy`` stays True. Only an
exception that escapes ``step`` (the engine's state is then unknown) fails every in-flight
request with `EngineDeadError` and marks the engine dead (``is_healthy`` False): a server
answers 503 from then on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine, PromptType
    from pagedkv.engine.stats import SchedulerStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_QUEUE_SIZE = 256

# Prompts with more characters are tokenized on the tokenizer pool, off the event loop: a few
# thousand characters tokenize in well under a millisecond; megabytes take seconds.
_INLINE_TOKENIZE_CHARS = 8192
TOKENIZER_POOL_WORKERS = 4


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (first 15 bytes) as its OS name (Linux; elsewhere a no-op).

    Python's thread names are invisible to ``top -H``, ``/proc/<pid>/task/*/comm`` and profilers;
    OS names make a server's CPU attributable per thread (``pagedkv bench serve`` reports it).
    Threads this one starts afterwards inherit the name: torch's OpenMP workers for the engine
    thread's parallel regions are then counted as engine work too."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
        except (OSError, AttributeError):
            pass


class QueueFullError(RuntimeError):
    """Too many requests are already waiting: retry later."""


class DuplicateRequestIdError(ValueError):
    """A request with this id is still in flight (a server answers 409)."""


class EngineDeadError(RuntimeError):
    """The engine thread failed or was shut down; no request can progress."""


class EngineGenerateError(RuntimeError):
    """This request failed because the engine step running it raised (vLLM's name); the
    engine is healthy and serves other and later requests."""


class StatLogger(Protocol):
    """Observes the engine (vLLM's ``StatLoggerBase``); every method runs on the engine thread."""

    def record_step(self, engine: LLMEngine, outputs: list[RequestOutput], now: float) -> None:
        """Called after every step that produced outputs (or changed state)."""

    def record_abort(self, request_ids: list[str]) -> None:
        """Called when user requests are aborted: forget whatever is tracked about them."""


class EventPublisher(Protocol):
    def publish(self, events: list[Any]) -> None: ...

    def shutdown(self) -> None: ...


_DONE = object()


@dataclass(eq=False)
class RequestStream:
    """Outputs of one user request, newest first-class: ``await stream.get()`` returns the most
    recent `RequestOutput` not yet seen (skipping older snapshots), or raises the engine's error.
    Iterate with ``async for out in stream``; it stops after the finished output."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    owner: AsyncLLM
    _latest: RequestOutput | None = None
    _error: BaseException | None = None
    _event: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False

    # -- called on the event loop thread (through call_soon_threadsafe) --
    def _put(self, out: RequestOutput) -> None:
        self._latest = out
        self._event.set()

    def _fail(self, err: BaseException) -> None:
        self._error = err
        self._event.set()

    # -- consumer side --
    async def get(self) -> RequestOutput:
        while self._latest is None and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._latest is not None:
            out, self._latest = self._latest, None
            if out.finished:
                self.finished = True
            return out
        assert self._error is not None
        self.finished = True
        raise self._error

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent, thread-safe)."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncLLM:
    """Serve an `LLMEngine` to asyncio code; see the module docstring."""

    def __init__(
        self,
        engine: LLMEngine | None = None,
        *,
        config: EngineConfig | None = None,
        max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
        event_publisher: EventPublisher | None = None,
        stat_loggers: list[StatLogger] | None = None,
    ) -> None:
        """Drive ``engine``, or build one from ``config`` *on the engine thread* (preferred:
        torch's intra-op thread pool and per-thread kernel caches then belong to the thread
        that steps the model; building the model on one thread and stepping it on another
        measured 10-20% slower on CPU). Returns once the engine is ready; a failure to build
        it is raised here."""
        if (engine is None) == (config is None):
            raise ValueError("pass exactly one of engine and config")
        if not isinstance(max_queue_size, int) or max_queue_size < 0:
            raise ValueError(f"invalid max_queue_size={max_queue_size!r}: must be an integer >= 0")
        self.engine = engine  # type: ignore[assignment]
        self.max_queue_size = max_queue_size
        self.event_publisher = event_publisher
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self._cv = threading.Condition()
        self._commands: list[tuple[Callable[[], None], concurrent.futures.Future | None]] = []
        self._streams: dict[str, RequestStream] = {}  # guarded by _cv
        self._stopping = False
        self._dead: BaseException | None = None
        self.num_aborted = 0
        self.num_rejected = 0
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            TOKENIZER_POOL_WORKERS,
            thread_name_prefix="pagedkv-tokenize",
            initializer=name_os_thread,
            initargs=("pagedkv-tokenize",),
        )
        self._thread = threading.Thread(
            target=self._main, args=(config,), name="pagedkv-engine", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            self._thread.join()
            self._tokenizer_pool.shutdown(wait=False)
            raise self._init_error
        self.max_in_flight = self.engine.config.max_num_seqs + max_queue_size

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLM:
        """`AsyncLLM` over a new engine built on the engine thread."""
        return cls(config=config, **kwargs)

    # ---- state --------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and not self._stopping and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        with self._cv:
            return len(self._streams)

    # ---- requests ---------------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        The prompt is tokenized and validated here, on a worker thread when it is long, before
        it reaches the engine thread: a huge prompt never stalls the other streams.
        Raises ValueError (invalid input: nothing queued), QueueFullError or EngineDeadError.
        """
        loop = asyncio.get_running_loop()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestStream(request_id, loop, self)
        with self._cv:
            self._check_alive()
            if request_id in self._streams:
                raise DuplicateRequestIdError(f"request id {request_id!r} is already in use")
            if len(self._streams) >= self.max_in_flight:
                self.num_rejected += 1
                raise QueueFullError(
                    f"the server is at capacity ({self.engine.config.max_num_seqs} running and "
                    f"{self.max_queue_size} waiting requests); retry later"
                )
            self._streams[request_id] = stream
        try:
            prompt = await self._process_prompt(loop, prompt)
            await self._compile_grammar(loop, params)
        except BaseException:
            with self._cv:
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]
            raise
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()

        def cmd() -> None:
            with self._cv:
                aborted = self._streams.get(request_id) is not stream
            if aborted:  # abort() came first (e.g. while tokenizing): never start it
                _set(fut, None)
                return
            try:
                self.engine.add_request(
                    request_id, prompt, params, arrival_time=arrival, cache_salt=cache_salt
                )
            except BaseException as e:
                with self._cv:
                    self._streams.pop(request_id, None)
                _set(fut, error=e)
            else:
                _set(fut, None)

        self._submit(cmd, fut)
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def _compile_grammar(
        self, loop: asyncio.AbstractEventLoop, params: SamplingParams
    ) -> None:
        """Compile a structured request's grammar on the worker pool (cached by the engine's
        `StructuredOutputManager`): a new JSON Schema can take tens of milliseconds, the
        first one of a backend seconds, and the engine thread then only hits the cache.
        SamplingParamError (a 400) for a grammar that does not compile."""
        so = params.structured_outputs
        if so is None:
            return
        manager = self.engine.structured_output_manager
        if not manager.is_cached(so):
            await loop.run_in_executor(self._tokenizer_pool, manager.compile, so)

    async def _process_prompt(
        self, loop: asyncio.AbstractEventLoop, prompt: PromptType
    ) -> PromptType:
        """``{"prompt_token_ids", "prompt"}`` for ``prompt``, tokenized and validated by the
        engine's thread-safe `process_prompt` (ValueError for a bad prompt): inline for short
        text and token ids, on the tokenizer pool for long text."""
        process = self.engine.process_prompt
        text = (
            prompt.get("prompt")
            if isinstance(prompt, dict) and "prompt_token_ids" not in prompt
            else prompt
        )
        if isinstance(text, str) and len(text) > _INLINE_TOKENIZE_CHARS:
            token_ids, text = await loop.run_in_executor(self._tokenizer_pool, process, prompt)
        else:
            token_ids, text = process(prompt)
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            # Images are decoded and preprocessed here, off the engine thread.
            token_ids, items = await loop.run_in_executor(
                self._tokenizer_pool, self.engine.process_images, prompt, token_ids
            )
            return {"prompt_token_ids": token_ids, "prompt": text, "mm_items": items}
        return {"prompt_token_ids": token_ids, "prompt": text}

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str) -> Any:
        """Async generator of `RequestOutput` snapshots; aborts the request if the consumer
        stops early (break, cancellation, error)."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str | list[str]) -> None:
        """Abort user requests (all their samples) and free their blocks; thread-safe, returns
        at once. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._cv:
            ids = [r for r in ids if self._streams.pop(r, None) is not None]
        if not ids:
            return

        def cmd() -> None:
            self.engine.abort_request(ids)
            self.num_aborted += len(ids)
            for sl in self.stat_loggers:
                sl.record_abort(ids)

        self._submit(cmd, None)

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` on the engine thread between two steps; its result or exception."""
        return await asyncio.wrap_future(self.call_in_engine(fn))

    def call_in_engine(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Thread-safe, non-async form of `run_in_engine`: a concurrent Future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def cmd() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the caller gave up (cancelled): do not run it
            try:
                result = fn(self.engine)
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(result)

        with self._cv:
            self._check_alive()
        self._submit(cmd, fut)
        return fut

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {self._dead!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _submit(self, cmd: Callable[[], None], fut: concurrent.futures.Future | None) -> None:
        with self._cv:
            if self._stopping or self._dead is not None:
                if fut is not None:
                    _set(fut, error=EngineDeadError("the engine is not running"))
                return
            self._commands.append((cmd, fut))
            self._cv.notify()

    # ---- the engine thread ------------------------------------------------------------------------

    def _main(self, config: EngineConfig | None) -> None:
        name_os_thread("pagedkv-engine")
        try:
            if config is not None:
                from pagedkv.engine.llm_engine import LLMEngine

                self.engine = LLMEngine(config)
            # The latest snapshot, replaced (never mutated) by the engine thread: readers on
            # other threads (metrics scrapes, the stats line) read it without a lock.
            self.last_stats: SchedulerStats = self.engine.make_stats()
        except BaseException as e:  # noqa: BLE001 - re-raised by __init__
            self._init_error = e
            self._ready.set()
            return
        self._ready.set()
        self._run()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._commands and not self._stopping and not engine.has_work():
                    self._cv.wait()
                cmds, self._commands = self._commands, []
                stopping = self._stopping
            try:
                for cmd, _ in cmds:
                    cmd()
                if stopping:
                    _fail_futures(cmds, EngineDeadError("the engine is shutting down"))
                    return
                t0 = time.perf_counter()
                # Also step with no request left while KV transfers are pending: the connector
                # must hear of their completion to free the blocks held for them.
                outputs = engine.step() if engine.has_work() else []
                idle = not outputs and time.perf_counter() - t0 < 0.0005
                self._after_step(outputs, changed=bool(cmds))
            except BaseException as e:
                logger.exception("engine step failed; failing all in-flight requests")
                self._die(e)
                return
            if idle:
                # Nothing could be scheduled (e.g. waiting on an offload tier's answer): do not
                # spin; a new command wakes the thread at once.
                with self._cv:
                    if not self._commands and not self._stopping:
                        self._cv.wait(0.002)

    def _after_step(self, outputs: list[RequestOutput], changed: bool) -> None:
        engine = self.engine
        now = time.monotonic()
        if engine.config.enable_kv_cache_events:  # drained even without a publisher: no backlog
            events = engine.take_kv_events()
            if events and self.event_publisher is not None:
                try:
                    self.event_publisher.publish(events)
                except Exception:  # a broken socket must not stop generation
                    logger.exception("publishing KV events failed")
        # A step without output may still free blocks (a lease expiring, a consumer done
        # reading): the snapshot follows the pool, or an idle server's gauges stay stale.
        freed = engine.kv_cache_manager.num_free_blocks != self.last_stats.num_free_blocks
        if outputs or changed or freed:
            self.last_stats = engine.make_stats()
            for sl in self.stat_loggers:
                try:
                    sl.record_step(engine, outputs, now)
                except Exception:
                    logger.exception("stat logger failed")
        if not outputs:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        with self._cv:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted meanwhile
                if out.finished:
                    del self._streams[out.request_id]
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: its consumers are gone
                pass

    def _die(self, err: BaseException) -> None:
        with self._cv:
            self._dead = err
            streams = list(self._streams.values())
            self._streams.clear()
            cmds, self._commands = self._commands, []
        _fail_all(streams, EngineDeadError(f"the engine failed: {err!r}"))
        _fail_futures(cmds, EngineDeadError(f"the engine failed: {err!r}"))
        try:
            self.engine.abort_request(list(self.engine.samples))
        except BaseException:
            logger.exception("could not abort requests after the engine failed")

    # ---- shutdown ----------------------------------------------------------------------------

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine thread (aborting every request) and the event publisher."""
        with self._cv:
            if self._stopping:
                return
            self._stopping = True
            streams = list(self._streams.values())
            self._streams.clear()
            self._cv.notify()
        self._thread.join(timeout)
        _fail_all(streams, EngineDeadError("the server is shutting down"))
        try:
            self.engine.abort_request(list(self.engine.samples))
            shutdown = getattr(self.engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
        except Exception:
            logger.exception("engine shutdown failed")
        if self.event_publisher is not None:
            self.event_publisher.shutdown()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def _set(
    fut: concurrent.futures.Future, result: Any = None, error: BaseException | None = None
) -> None:
    """Complete ``fut`` unless its waiter cancelled it meanwhile."""
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:  # cancelled between the check and the set
        pass


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Hand each stream its output; a request failed by its step gets `EngineGenerateError`."""
    for stream, out in items:
        error = getattr(out, "error", None)
        if error is not None:
            stream._fail(EngineGenerateError(f"request {out.request_id} failed: {error}"))
        else:
            stream._put(out)


def _fail_futures(
    cmds: list[tuple[Callable[[], None], concurrent.futures.Future | None]], err: BaseException
) -> None:
    for _, fut in cmds:
        if fut is not None:
            _set(fut, error=err)


def _fail_all(streams: list[RequestStream], err: BaseException) -> None:
    for stream in streams:
        try:
            stream.loop.call_soon_threadsafe(stream._fail, err)
        except RuntimeError:
            pass
