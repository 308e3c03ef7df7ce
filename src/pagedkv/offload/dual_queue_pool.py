"""DualQueueThreadPool: I/O threads with separate read and write queues, reads first.

A read (a load a request waits for, or an existence check) should never queue behind a burst
of write-backs nobody waits for. Every thread takes reads before writes, except one thread
(when there are two or more) that takes writes first, so a steady read stream cannot starve
the writes forever. Jobs are plain callables; results come back as `concurrent.futures.Future`.
Threads are daemons: a tier hung in a syscall never keeps the process alive at exit.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
_Job = tuple[Future, Callable[..., Any], tuple[Any, ...]]


class DualQueueThreadPool:
    def __init__(self, num_threads: int, name: str = "offload-io") -> None:
        if num_threads <= 0:
            raise ValueError("num_threads must be positive")
        self._reads: deque[_Job] = deque()
        self._writes: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._shutdown = False
        self._busy = 0
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(num_threads > 1 and i == num_threads - 1,),
                name=f"{name}-{i}",
                daemon=True,
            )
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit_read(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._submit(self._reads, fn, args)

    def submit_write(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._submit(self._writes, fn, args)

    def _submit(self, queue: deque[_Job], fn: Callable[..., Any], args: tuple[Any, ...]) -> Future:
        fut: Future = Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("DualQueueThreadPool is shut down")
            queue.append((fut, fn, args))
            self._cond.notify_all()  # not notify(): a wait_idle() waiter could take it
        return fut

    @property
    def num_pending_reads(self) -> int:
        return len(self._reads)

    @property
    def num_pending_writes(self) -> int:
        return len(self._writes)

    @property
    def idle(self) -> bool:
        with self._cond:
            return not (self._reads or self._writes or self._busy)

    def _next_job(self, writes_first: bool) -> _Job | None:
        with self._cond:
            while not (self._reads or self._writes or self._shutdown):
                self._cond.wait()
            first, second = (
                (self._writes, self._reads) if writes_first else (self._reads, self._writes)
            )
            queue = first if first else second
            if not queue:  # shut down and drained
                return None
            self._busy += 1
            return queue.popleft()

    def _run(self, writes_first: bool) -> None:
        while (job := self._next_job(writes_first)) is not None:
            fut, fn, args = job
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as exc:  # noqa: BLE001 - handed to the future's owner
                        fut.set_exception(exc)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until both queues are empty and no job runs; False on timeout (tests, shutdown)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._reads or self._writes or self._busy), timeout
            )

    def shutdown(
        self, wait: bool = True, cancel_pending: bool = False, timeout: float | None = None
    ) -> None:
        """Stop accepting jobs; run (or cancel) what is queued; join the threads if ``wait``."""
        with self._cond:
            self._shutdown = True
            if cancel_pending:
                for fut, _, _ in (*self._reads, *self._writes):
                    fut.cancel()
                self._reads.clear()
                self._writes.clear()
            self._cond.notify_all()
        if wait:
            for t in self._threads:
                t.join(timeout)
