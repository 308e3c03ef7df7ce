"""KV cache events over ZMQ, in vLLM's wire format: a publisher with replay, and a subscriber.

Beside events.py (the payload) and torch-free like all of core/: the server publishes with it
(`pagedkv.entrypoints.openai.api_server`), the router (`pagedkv.router.subscriber`), the
``pagedkv events`` command and the benchmarks subscribe.

Wire format (vLLM's ``ZmqEventPublisher``, see core/events.py for the payload):

* PUB socket, one multipart message per batch: ``(topic, seq, payload)`` where ``seq`` is an
  8-byte big-endian unsigned integer starting at 0 and increasing by 1 per batch, and
  ``payload`` is a msgpack ``KVEventBatch``: ``[ts, [events...], data_parallel_rank]``, each
  event a map tagged with its type (``{"type": "BlockStored", "block_hashes": [...], ...}``).
* ROUTER replay socket (optional): a client (DEALER, or REQ) sends ``(b"", start_seq)``
  (8-byte big-endian); the server answers ``(b"", topic, seq, payload)`` for every buffered
  batch with ``seq >= start_seq``, then the end marker ``(b"", b"", seq=-1 (8-byte big-endian
  signed), b"")``. The last ``buffer_steps`` batches are kept.

Endpoints: unlike vLLM (which connects when a tcp endpoint names a host), the publisher always
*binds* its endpoints and subscribers connect — the ``pagedkv events`` command connects to the
server's ``--kv-events-endpoint``. A tcp port of ``0`` (or ``*``) binds a free port; the
publisher's ``endpoint`` / ``replay_endpoint`` attributes then hold the real ones.

All socket I/O happens on one daemon thread; `publish` only enqueues (it never blocks the
engine: when the bounded queue is full the batch is dropped and counted).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

from pagedkv.core.events import KVEventBatch, decode_batch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = -1
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint``; ``tcp://host:0`` or ``tcp://host:*`` picks a free port. Returns the
    bound endpoint."""
    m = re.fullmatch(r"tcp://(.+):(0|\*)", endpoint)
    if m:
        port = sock.bind_to_random_port(f"tcp://{m.group(1)}")
        return f"tcp://{m.group(1)}:{port}"
    sock.bind(endpoint)
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) and last else endpoint


class ZmqEventPublisher:
    """Publish `KVEventBatch`es on a PUB socket and serve replays on a ROUTER socket.

    ``publish(events)`` stamps a batch (wall-clock ``ts``) and enqueues it; the publisher
    thread assigns the sequence number, sends it, and keeps ``(seq, payload)`` in a ring of
    ``buffer_steps`` batches for replay. Sockets are bound before the constructor returns, so
    ``endpoint`` and ``replay_endpoint`` are final (and bind errors raise here).
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        data_parallel_rank: int | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.queue: queue.Queue[KVEventBatch | bytes | None] = queue.Queue(maxsize=max_queue_size)
        self.num_dropped = 0
        self.next_seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._encoder = msgspec.msgpack.Encoder()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    # ---- producer side (engine thread) -------------------------------------------------------

    def publish(self, events: list[Any] | KVEventBatch) -> None:
        if not self._running:
            return
        if isinstance(events, KVEventBatch):
            batch = events
        else:
            batch = KVEventBatch(ts=time.time(), events=list(events))
        if self.data_parallel_rank is not None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self.queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV event queue full: dropped a batch of %d events", len(batch.events))

    def publish_payload(self, payload: bytes) -> None:
        """Publish an already-encoded batch as it is (bytes in vLLM's wire format, e.g. relayed
        from another publisher or recorded from one): numbered, buffered for replay and sent
        like any batch, never re-encoded."""
        if not self._running:
            return
        try:
            self.queue.put_nowait(bytes(payload))
        except queue.Full:
            self.num_dropped += 1
            logger.warning("KV event queue full: dropped an encoded batch")

    # ---- publisher thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    self._serve_replays()
                try:
                    batch = self.queue.get(timeout=0.02 if self._replay is not None else 0.2)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                self._send(batch)
        except zmq.ZMQError as e:
            if self._running:
                logger.error("KV event publisher stopped: %s", e)
        finally:
            # Send what was queued before the shutdown, then close.
            while True:
                try:
                    batch = self.queue.get_nowait()
                except queue.Empty:
                    break
                if batch is not None:
                    try:
                        self._send(batch)
                    except zmq.ZMQError:
                        break
            self._close_sockets()

    def _send(self, batch: KVEventBatch | bytes) -> None:
        payload = batch if isinstance(batch, bytes) else encode_batch(batch)
        seq = self.next_seq
        self.next_seq += 1
        self._pub.send_multipart((self.topic, seq_bytes(seq), payload), copy=False)
        self.buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        sock = self._replay
        assert sock is not None
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) < 3:
                logger.warning("malformed replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], frames[-1]
            try:
                start_seq = int.from_bytes(start, "big")
            except (TypeError, ValueError):
                start_seq = 0
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    sock.send_multipart((identity, b"", self.topic, seq_bytes(seq), payload))
            sock.send_multipart((identity, b"", b"", seq_bytes(END_SEQ), b""))

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    def shutdown(self, timeout: float = 1.0) -> None:
        """Flush queued batches (up to ``timeout``) and close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self.queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)


class NullEventPublisher:
    """Drops every batch (events disabled)."""

    def publish(self, events: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


# ---- subscriber ---------------------------------------------------------------------------------


class KVEventSubscriber:
    """Receive KV event batches: ``recv()`` from the PUB endpoint, ``replay(start_seq)`` from the
    replay endpoint. Decoded batches are `KVEventBatch` structs."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)

    def recv(self, timeout: float | None = None) -> tuple[int, KVEventBatch] | None:
        """The next ``(seq, batch)``, or None after ``timeout`` seconds without one."""
        if timeout is not None and not self._sub.poll(int(timeout * 1000)):
            return None
        _topic, seq, payload = self._sub.recv_multipart()
        return int.from_bytes(seq, "big"), decode_batch(payload)

    def replay(self, start_seq: int = 0, timeout: float = 5.0) -> list[tuple[int, KVEventBatch]]:
        """Every buffered batch with ``seq >= start_seq``, oldest first (until the end marker).
        TimeoutError if the server does not finish answering within ``timeout`` seconds."""
        if self._replay is None:
            raise ValueError("no replay endpoint given")
        self._replay.send_multipart((b"", seq_bytes(start_seq)))
        out: list[tuple[int, KVEventBatch]] = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._replay.poll(int(left * 1000)):
                raise TimeoutError(f"no end of replay within {timeout} s")
            frames = self._replay.recv_multipart()
            frames = frames[1:] if frames and frames[0] == b"" else frames
            _topic, seq_b, payload = frames[-3], frames[-2], frames[-1]
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == END_SEQ and not payload:
                return out
            out.append((seq, decode_batch(payload)))

    def close(self) -> None:
        for s in (self._sub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def event_to_json(event: Any) -> dict[str, Any]:
    """One event as a JSON-ready dict: ``{"type": ..., fields...}``; bytes hashes → hex."""
    d: dict[str, Any] = {"type": type(event).__name__}
    d.update(msgspec.to_builtins(event, builtin_types=(bytes, bytearray)))
    return _hexify(d)


def _hexify(x: Any) -> Any:
    if isinstance(x, (bytes, bytearray)):
        return bytes(x).hex()
    if isinstance(x, dict):
        return {k: _hexify(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_hexify(v) for v in x]
    return x


def iter_event_lines(seq: int, batch: KVEventBatch) -> Iterator[dict[str, Any]]:
    """The JSON objects ``pagedkv events`` prints for one batch: one per event, with ``seq``,
    the batch's ``ts`` and ``dp_rank``."""
    for event in batch.events:
        d = {"seq": seq, "ts": batch.ts, "dp_rank": batch.data_parallel_rank}
        d.update(event_to_json(event))
        yield d
