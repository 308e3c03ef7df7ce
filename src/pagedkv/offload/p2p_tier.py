"""`P2PTier`: instances serve each other's cached prefixes (vLLM's tiering P2P, ``--kv-offload
...,p2p:PEER_HOST:PORT,p2p-listen:[HOST:]PORT:SIZE``).

A secondary tier below the CPU tier, like disk and Redis, so the tiering manager's asynchronous
lookups (``RETRY`` / ``HIT_PENDING``), promotions and load path are reused unchanged:

* **serving** (``p2p-listen``): every chunk this instance's CPU tier cascades down is copied
  into the tier's own chunk store (``SIZE`` bytes of registered host memory, LRU). A ZMQ ROUTER
  thread answers peers: ``connect`` (the handshake: offload fingerprint — model, dtype, block
  size, layout — hash seed, chunk size and the transfer backend's metadata; any difference is
  refused naming the field), ``lookup`` (which keys it holds; with ``pin`` their slots are
  leased for ``lease_s`` so they cannot be evicted while a peer reads them, plus each chunk's
  xxh3 checksum) and ``release``.
* **reading** (``p2p``): `exists_batch` asks the peers (batched); `load_batch` pins the hits at
  a peer, reads the slots with the `KVTransferBackend` (NIXL or TCP) into slots of its own
  store, verifies the checksums, copies them into the CPU tier's chunks and releases the pins.
  Chunks read from a peer stay in the local store, so they are served onward too.

Failure policy (a tier never raises into the engine): an unreachable, refused or failing peer
is a miss, marked unhealthy for ``cooldown_s`` and skipped meanwhile; a checksum mismatch is a
miss counted as ``corrupted``. KV events: chunks entering / leaving the store are reported with
medium ``P2P`` (`take_events`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import xxhash
import zmq

from pagedkv.offload.base import ChunkItems, OffloadKey, RateLimitedWarning, SecondaryTier
from pagedkv.offload.dual_queue_pool import DualQueueThreadPool
from pagedkv.transfer import get_transfer_backend
from pagedkv.transfer.base import KVTransferBackend, MemoryRegion

logger = logging.getLogger(__name__)
_warn = RateLimitedWarning(logger)
MEDIUM_P2P = "P2P"
PROTOCOL_VERSION = 1


class ChunkStore:
    """``num_slots`` chunks of ``chunk_bytes`` in one registered numpy buffer, indexed by key,
    LRU; a pinned (leased) slot is never evicted. Thread-safe (one lock)."""

    def __init__(self, num_slots: int, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.buffer = np.zeros((max(num_slots, 1), chunk_bytes), dtype=np.uint8)
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()  # key -> slot, LRU first
        self._sums: dict[int, int] = {}  # slot -> xxh3_64 of its bytes
        self._pins: dict[int, float] = {}  # slot -> lease expiry (monotonic)
        self._free = list(range(num_slots - 1, -1, -1))
        self.evicted: list[OffloadKey] = []  # for events, drained by the tier

    def region(self) -> MemoryRegion:
        return MemoryRegion(
            self.buffer.ctypes.data, self.buffer.shape[0], self.chunk_bytes, self.chunk_bytes
        )

    def _take_slot(self, now: float) -> int | None:
        if self._free:
            return self._free.pop()
        for key, slot in self._index.items():  # LRU first
            if self._pins.get(slot, 0.0) <= now:
                del self._index[key]
                self._pins.pop(slot, None)
                self._sums.pop(slot, None)
                self.evicted.append(key)
                return slot
        return None  # everything is leased to readers

    def put(self, key: OffloadKey, payload: memoryview | bytes) -> bool:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            slot = self._take_slot(time.monotonic())
            if slot is None:
                return False
            self.buffer[slot] = np.frombuffer(payload, dtype=np.uint8)
            self._sums[slot] = xxhash.xxh3_64_intdigest(self.buffer[slot])
            self._index[key] = slot
            return True

    def reserve(self, key: OffloadKey, lease_s: float) -> int | None:
        """A slot to read ``key`` into from a peer (pinned, not indexed until `commit`)."""
        with self._lock:
            now = time.monotonic()
            slot = self._take_slot(now)
            if slot is not None:
                self._pins[slot] = now + lease_s
            return slot

    def verify(self, slot: int, checksum: int) -> bool:
        return xxhash.xxh3_64_intdigest(self.buffer[slot]) == checksum

    def commit(self, key: OffloadKey, slot: int, checksum: int) -> None:
        """Index a reserved slot whose (verified) bytes arrived, so it is served onward."""
        with self._lock:
            self._pins.pop(slot, None)
            if key in self._index:  # another reader got it first
                self._free.append(slot)
                return
            self._sums[slot] = checksum
            self._index[key] = slot

    def abandon(self, slot: int) -> None:
        with self._lock:
            self._pins.pop(slot, None)
            self._free.append(slot)

    def lookup(self, keys: Sequence[OffloadKey], pin_s: float = 0.0) -> list[tuple[int, int]]:
        """``(slot, checksum)`` per key, ``(-1, 0)`` if absent; hits leased for ``pin_s``."""
        with self._lock:
            now = time.monotonic()
            out = []
            for key in keys:
                slot = self._index.get(key)
                if slot is None:
                    out.append((-1, 0))
                    continue
                self._index.move_to_end(key)
                if pin_s > 0:
                    self._pins[slot] = max(self._pins.get(slot, 0.0), now + pin_s)
                out.append((slot, self._sums[slot]))
            return out

    def release(self, keys: Sequence[OffloadKey]) -> None:
        with self._lock:
            for key in keys:
                slot = self._index.get(key)
                if slot is not None:
                    self._pins.pop(slot, None)

    def copy_out(self, slot: int, dst: memoryview) -> None:
        dst[:] = memoryview(self.buffer[slot]).cast("B")

    def __contains__(self, key: OffloadKey) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)


@dataclass(slots=True)
class _Peer:
    host: str
    port: int
    name: str | None = None  # the backend's peer name once connected
    down_until: float = 0.0
    error: str | None = None
    sock: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class P2PTier(SecondaryTier):
    """See the module docstring. ``fingerprint``: the offload fingerprint's hex digest;
    ``hash_seed``: how block hashes (hence offload keys) are made."""

    def __init__(
        self,
        peers: Sequence[tuple[str, int]],
        fingerprint: str,
        hash_seed: str,
        chunk_bytes: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        capacity_bytes: int = 0,
        backend: str | None = None,
        timeout_s: float = 2.0,
        lease_s: float = 10.0,
        cooldown_s: float = 10.0,
        num_threads: int = 2,
        name: str = "p2p",
    ) -> None:
        super().__init__(name, MEDIUM_P2P, capacity_bytes)
        self.fingerprint, self.hash_seed, self.chunk_bytes = fingerprint, hash_seed, chunk_bytes
        self.timeout_s, self.lease_s, self.cooldown_s = timeout_s, lease_s, cooldown_s
        # Readers need slots to read into even when they serve nothing: at least 64.
        num_slots = max(capacity_bytes // chunk_bytes, 64)
        self.store = ChunkStore(num_slots, chunk_bytes)
        self.serving = listen_port > 0
        self.backend: KVTransferBackend = get_transfer_backend(
            f"p2p-{id(self):x}-{listen_port}", backend
        )
        self.backend.register_kv_memory([self.store.region()])
        self._backend_lock = threading.Lock()  # NIXL is not thread-safe
        self._peers = [_Peer(h, p) for h, p in peers]
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._server: threading.Thread | None = None
        if self.serving:
            self._server_sock = self._ctx.socket(zmq.ROUTER)
            self._server_sock.setsockopt(zmq.LINGER, 0)
            try:
                self._server_sock.bind(f"tcp://{listen_host}:{listen_port}")
            except zmq.ZMQError as e:
                self._server_sock.close()
                raise ValueError(
                    f"p2p-listen: cannot listen on {listen_host}:{listen_port}: {e}"
                ) from None
            self._server = threading.Thread(target=self._serve, name="p2p-server", daemon=True)
            self._server.start()
        self.pool = DualQueueThreadPool(num_threads, f"{name}-io")
        logger.info(
            "P2P tier: serving %s, %d peer(s), transfer backend %s",
            f"{listen_host}:{listen_port}" if self.serving else "nothing",
            len(self._peers),
            self.backend.kind,
        )

    # ---- serving (ZMQ thread) ---------------------------------------------------------------------

    def _hello(self) -> dict[str, Any]:
        return {
            "version": PROTOCOL_VERSION,
            "fingerprint": self.fingerprint,
            "hash_seed": self.hash_seed,
            "chunk_bytes": self.chunk_bytes,
            "backend": self.backend.kind,
            "agent_metadata": self.backend.get_agent_metadata(),
        }

    def _answer(self, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg.get("type")
        if kind == "connect":
            why = compat_error(self._hello(), msg)
            return {"ok": why is None, "error": why, **self._hello()}
        if kind == "lookup":
            found = self.store.lookup(msg["keys"], self.lease_s if msg.get("pin") else 0.0)
            return {"slots": [s for s, _ in found], "sums": [c for _, c in found]}
        if kind == "release":
            self.store.release(msg["keys"])
            return {"ok": True}
        return {"error": f"unknown message type {kind!r}"}

    def _serve(self) -> None:
        sock = self._server_sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, _, data = sock.recv_multipart()
            try:
                reply = self._answer(msgspec.msgpack.decode(data))
            except Exception as e:  # noqa: BLE001 - a bad message gets an error, the server lives
                reply = {"error": f"{type(e).__name__}: {e}"}
            sock.send_multipart([ident, b"", msgspec.msgpack.encode(reply)])
        sock.close()

    # ---- reading (tier I/O threads) ---------------------------------------------------------------

    def _request(self, peer: _Peer, msg: dict[str, Any]) -> dict[str, Any] | None:
        """One request/reply with ``peer`` (under its lock); None on timeout (the socket is
        then dropped: a REQ socket that missed a reply cannot be reused)."""
        with peer.lock:
            if peer.sock is None:
                peer.sock = self._ctx.socket(zmq.REQ)
                peer.sock.setsockopt(zmq.LINGER, 0)
                peer.sock.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
                peer.sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
                peer.sock.connect(f"tcp://{peer.host}:{peer.port}")
            try:
                peer.sock.send(msgspec.msgpack.encode(msg))
                return msgspec.msgpack.decode(peer.sock.recv())
            except zmq.ZMQError:
                peer.sock.close()
                peer.sock = None
                return None

    def _down(self, peer: _Peer, why: str) -> None:
        peer.down_until = time.monotonic() + self.cooldown_s
        peer.error = why
        _warn(
            f"p2p-{peer.host}:{peer.port}",
            "%s: peer %s:%d skipped for %.0f s: %s",
            self.name,
            peer.host,
            peer.port,
            self.cooldown_s,
            why,
        )

    def _connected(self, peer: _Peer) -> bool:
        """Connect (handshake) once; False while the peer is down or refused."""
        if time.monotonic() < peer.down_until:
            return False
        if peer.name is not None:
            return True
        reply = self._request(peer, {"type": "connect", **self._hello()})
        if reply is None:
            self._down(peer, "no answer")
            return False
        why = reply.get("error") or compat_error(self._hello(), reply)
        if why is not None:
            self._down(peer, f"refused: {why}")
            return False
        try:
            with self._backend_lock:
                peer.name = self.backend.add_remote_agent(reply["agent_metadata"])
        except Exception as e:  # noqa: BLE001
            self._down(peer, f"transfer backend: {e}")
            return False
        return True

    @property
    def healthy(self) -> bool:
        return not self._peers or any(time.monotonic() >= p.down_until for p in self._peers)

    def exists_batch(self, keys: Sequence[OffloadKey]) -> list[bool]:
        out = [False] * len(keys)
        for peer in self._peers:
            todo = [i for i, hit in enumerate(out) if not hit]
            if not todo or not self._connected(peer):
                continue
            reply = self._request(peer, {"type": "lookup", "keys": [keys[i] for i in todo]})
            if reply is None or "slots" not in reply:
                self._down(peer, "lookup failed")
                continue
            for i, slot in zip(todo, reply["slots"]):
                out[i] = slot >= 0
        with self._lock:
            self.stats.hits += sum(out)
            self.stats.misses += len(out) - sum(out)
        return out

    def load_batch(self, items: ChunkItems) -> list[bool]:
        out = [False] * len(items)
        for peer in self._peers:
            todo = [i for i, ok in enumerate(out) if not ok]
            if not todo or not self._connected(peer):
                continue
            keys = [items[i][0] for i in todo]
            reply = self._request(peer, {"type": "lookup", "keys": keys, "pin": True})
            if reply is None or "slots" not in reply:
                self._down(peer, "lookup failed")
                continue
            try:
                self._read(
                    peer,
                    [(i, s, c) for i, s, c in zip(todo, reply["slots"], reply["sums"]) if s >= 0],
                    items,
                    out,
                )
            finally:
                self._request(peer, {"type": "release", "keys": keys})
        with self._lock:
            self.stats.loads += sum(out)
            self.stats.load_failures += len(out) - sum(out)
            self.stats.bytes_read += sum(out) * self.chunk_bytes
        return out

    def _read(
        self, peer: _Peer, hits: list[tuple[int, int, int]], items: ChunkItems, out: list[bool]
    ) -> None:
        """Read the peer's leased slots into reserved local slots, verify, copy out."""
        local: list[
            tuple[int, int, int, int]
        ] = []  # (item index, local slot, remote slot, checksum)
        for i, rslot, checksum in hits:
            slot = self.store.reserve(items[i][0], self.lease_s)
            if slot is not None:
                local.append((i, slot, rslot, checksum))
        if not local:
            return
        with self._backend_lock:
            handle = self.backend.read_blocks(
                peer.name, [s for _, s, _, _ in local], [r for _, _, r, _ in local]
            )
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._backend_lock:
                state = self.backend.check_xfer_state(handle)
            if state != "PROC" or time.monotonic() > deadline:
                break
            time.sleep(0.0005)
        with self._backend_lock:
            self.backend.release_xfer(handle)
        if state != "DONE":
            for _, slot, _, _ in local:
                self.store.abandon(slot)
            self._down(peer, f"read {state if state != 'PROC' else 'timed out'}")
            return
        corrupted = 0
        for i, slot, _, checksum in local:  # still leased: verify and copy, then index it
            key, dst = items[i]
            if not self.store.verify(slot, checksum) or dst.nbytes != self.chunk_bytes:
                corrupted += 1
                self.store.abandon(slot)
                continue
            self.store.copy_out(slot, dst)
            self.store.commit(key, slot, checksum)
            out[i] = True
        if corrupted:
            with self._lock:
                self.stats.corrupted += corrupted
            _warn(
                "p2p-corrupt",
                "%s: %d chunks from %s:%d failed their checksum",
                self.name,
                corrupted,
                peer.host,
                peer.port,
            )

    def store_batch(self, items: ChunkItems) -> list[bool]:
        """Keep a copy of this instance's chunks for its peers (nothing to do when not serving)."""
        if not self.serving:
            return [False] * len(items)
        out = [d.nbytes == self.chunk_bytes and self.store.put(k, d) for k, d in items]
        with self._lock:
            self.stats.stores += sum(out)
            self.stats.store_failures += len(out) - sum(out)
            self.stats.bytes_written += sum(out) * self.chunk_bytes
            self.stats.usage_bytes = len(self.store) * self.chunk_bytes
        self._emit([k for (k, _), ok in zip(items, out) if ok], removed=False)
        return out

    def take_events(self):  # type: ignore[override]
        with self.store._lock:
            evicted, self.store.evicted = self.store.evicted, []
        self._emit(evicted, removed=True)
        return super().take_events()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=2.0)
        super().shutdown(timeout)
        for peer in self._peers:
            with peer.lock:
                if peer.sock is not None:
                    peer.sock.close()
        with self._backend_lock:
            self.backend.shutdown()


def compat_error(local: dict[str, Any], remote: dict[str, Any]) -> str | None:
    """The first field on which two P2P tiers disagree (their chunks would not be
    interchangeable), as a message naming it; None if they agree."""
    for name in ("version", "fingerprint", "hash_seed", "chunk_bytes", "backend"):
        if local.get(name) != remote.get(name):
            hint = (
                " (ensure PYTHONHASHSEED and the hash algorithm match)"
                if name == "hash_seed"
                else ""
            )
            return f"{name} differs (local {local.get(name)!r}, peer {remote.get(name)!r}){hint}"
    return None


__all__ = ["ChunkStore", "MEDIUM_P2P", "P2PTier", "compat_error"]
