"""`P2PTier`: instances serve each other's cached prefixes (vLLM's tiering P2P, ``--kv-offload
...,p2p:PEER_HOST:PORT[:CODEC],p2p-listen:[HOST:]PORT:SIZE[:CODEC]``).

A secondary tier below the CPU tier, like disk and Redis, so the tiering manager's asynchronous
lookups (``RETRY`` / ``HIT_PENDING``), promotions and load path are reused unchanged:

* **serving** (``p2p-listen``): every chunk this instance's CPU tier cascades down is encoded
  with the tier's codec (`offload.codec`; raw by default) and kept in the tier's own chunk
  store (``SIZE`` bytes of registered host memory in units, LRU). A ZMQ ROUTER thread answers
  peers: ``connect`` (the handshake: offload fingerprint — model, dtype, block size, layout,
  codec — hash seed, chunk size, codec and unit size, and the transfer backend's metadata; any
  difference is refused naming the field), ``lookup`` (which keys it holds: their units,
  payload lengths and xxh3 checksums of the encoded bytes; with ``pin`` they are leased for
  ``lease_s`` so they cannot be evicted while a peer reads them) and ``release``.
* **reading** (``p2p``): `exists_batch` asks the peers (batched); `load_batch` pins the hits at
  a peer, reads their units with the `KVTransferBackend` (NIXL or TCP) into units of its own
  store (an encoded chunk's payload alone crosses the wire), verifies the checksums, decodes
  into the CPU tier's chunks on the tier's I/O thread and releases the pins. Chunks read from
  a peer stay in the local store, so they are served onward too.

Failure policy (a tier never raises into the engine): an unreachable, refused or failing peer
is a miss, marked unhealthy for ``cooldown_s`` and skipped meanwhile; a checksum mismatch, or a
payload the codec cannot decode, is a miss counted as ``corrupted``. KV events: chunks entering
/ leaving the store are reported with medium ``P2P`` (`take_events`).
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
from pagedkv.offload.codec import CodecError, KVCodec
from pagedkv.offload.dual_queue_pool import DualQueueThreadPool
from pagedkv.transfer import get_transfer_backend
from pagedkv.transfer.base import KVTransferBackend, MemoryRegion

logger = logging.getLogger(__name__)
_warn = RateLimitedWarning(logger)
MEDIUM_P2P = "P2P"
PROTOCOL_VERSION = 2  # 2: chunks in units, lookups answer units/lengths/sums


@dataclass(frozen=True, slots=True)
class _Hit:
    """A peer's answer for one wanted chunk: item ``index``, its units there, payload bytes,
    checksum."""

    index: int
    units: list[int]
    length: int
    checksum: int


@dataclass(slots=True)
class _Entry:
    units: list[int]  # the store units holding the payload, in order
    length: int  # payload bytes (the last unit is used up to here)
    checksum: int  # xxh3_64 of the payload


class ChunkStore:
    """Encoded chunks in ``num_units`` units of ``unit_bytes`` (one registered numpy buffer),
    indexed by key, LRU; a chunk takes ``ceil(len / unit_bytes)`` units, anywhere (a peer reads
    them as a list of blocks, so only the payload's units cross the wire). A pinned (leased)
    entry is never evicted. Without a codec a unit is a whole chunk. Thread-safe (one lock)."""

    def __init__(self, num_units: int, unit_bytes: int) -> None:
        self.unit_bytes = unit_bytes
        self.buffer = np.zeros((max(num_units, 1), unit_bytes), dtype=np.uint8)
        self.num_units = num_units
        self._lock = threading.Lock()
        self._index: OrderedDict[OffloadKey, _Entry] = OrderedDict()  # LRU first
        self._pins: dict[OffloadKey, float] = {}  # key -> lease expiry (monotonic)
        self._free = list(range(num_units - 1, -1, -1))
        self.evicted: list[OffloadKey] = []  # for events, drained by the tier

    def region(self) -> MemoryRegion:
        return MemoryRegion(
            self.buffer.ctypes.data, self.buffer.shape[0], self.unit_bytes, self.unit_bytes
        )

    def units_for(self, length: int) -> int:
        return max(1, -(-length // self.unit_bytes))

    def _take_units(self, n: int, now: float) -> list[int] | None:
        """``n`` free units, evicting unpinned entries LRU first; None (nothing taken) if
        pinned entries hold too many."""
        if len(self._free) < n:
            evictable = sum(
                len(e.units) for k, e in self._index.items() if self._pins.get(k, 0.0) <= now
            )
            if len(self._free) + evictable < n:  # evict nothing for a chunk that cannot fit
                return None
            for key in list(self._index):
                if len(self._free) >= n:
                    break
                if self._pins.get(key, 0.0) > now:
                    continue
                self._free.extend(self._index.pop(key).units)
                self._pins.pop(key, None)
                self.evicted.append(key)
        if len(self._free) < n:
            return None
        return [self._free.pop() for _ in range(n)]

    def _write(self, units: list[int], payload: memoryview) -> None:
        flat = np.frombuffer(payload, dtype=np.uint8)
        for i, u in enumerate(units):
            part = flat[i * self.unit_bytes : (i + 1) * self.unit_bytes]
            self.buffer[u, : part.size] = part

    def read(self, units: list[int], length: int) -> bytes:
        """The payload stored in ``units`` (one copy)."""
        return self.buffer[units].reshape(-1)[:length].tobytes()

    def put(self, key: OffloadKey, payload: memoryview | bytes) -> bool:
        payload = memoryview(payload).cast("B")
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            units = self._take_units(self.units_for(payload.nbytes), time.monotonic())
            if units is None:
                return False
            self._write(units, payload)
            self._index[key] = _Entry(units, payload.nbytes, xxhash.xxh3_64_intdigest(payload))
            return True

    def reserve(self, length: int) -> list[int] | None:
        """Units to read a peer's ``length``-byte payload into (not indexed until `commit`)."""
        with self._lock:
            return self._take_units(self.units_for(length), time.monotonic())

    def verify(self, units: list[int], length: int, checksum: int) -> bool:
        return xxhash.xxh3_64_intdigest(self.read(units, length)) == checksum

    def commit(self, key: OffloadKey, units: list[int], length: int, checksum: int) -> None:
        """Index reserved units whose (verified) payload arrived, so it is served onward."""
        with self._lock:
            if key in self._index:  # another reader got it first
                self._free.extend(units)
                return
            self._index[key] = _Entry(units, length, checksum)

    def abandon(self, units: list[int]) -> None:
        with self._lock:
            self._free.extend(units)

    def lookup(self, keys: Sequence[OffloadKey], pin_s: float = 0.0) -> list[_Entry | None]:
        """Each key's entry (None if absent); hits leased for ``pin_s``."""
        with self._lock:
            now = time.monotonic()
            out: list[_Entry | None] = []
            for key in keys:
                entry = self._index.get(key)
                if entry is not None:
                    self._index.move_to_end(key)
                    if pin_s > 0:
                        self._pins[key] = max(self._pins.get(key, 0.0), now + pin_s)
                out.append(entry)
            return out

    def release(self, keys: Sequence[OffloadKey]) -> None:
        with self._lock:
            for key in keys:
                self._pins.pop(key, None)

    def stored_bytes(self) -> int:
        """Bytes of the units in use."""
        with self._lock:
            return (self.num_units - len(self._free)) * self.unit_bytes

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
        codec: KVCodec | None = None,
    ) -> None:
        super().__init__(name, MEDIUM_P2P, capacity_bytes)
        self.fingerprint, self.hash_seed, self.chunk_bytes = fingerprint, hash_seed, chunk_bytes
        self.timeout_s, self.lease_s, self.cooldown_s = timeout_s, lease_s, cooldown_s
        self.codec = codec if codec is not None and codec.name != "raw" else None
        # A raw chunk is one unit; an encoded one takes as many 1/16-chunk units as it needs
        # (its payload alone crosses the wire).
        unit = chunk_bytes if self.codec is None else max(-(-chunk_bytes // 16), 512)
        # Readers need units to read into even when they serve nothing: 64 chunks' worth.
        num_units = max(capacity_bytes // unit, 64 * -(-chunk_bytes // unit))
        self.store = ChunkStore(num_units, unit)
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
            "codec": self.codec.name if self.codec is not None else "raw",
            "unit_bytes": self.store.unit_bytes,
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
            return {
                "units": [e.units if e is not None else [] for e in found],
                "lengths": [e.length if e is not None else 0 for e in found],
                "sums": [e.checksum if e is not None else 0 for e in found],
            }
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
            if reply is None or "units" not in reply:
                self._down(peer, "lookup failed")
                continue
            for i, units in zip(todo, reply["units"]):
                out[i] = bool(units)
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
            if reply is None or "units" not in reply:
                self._down(peer, "lookup failed")
                continue
            hits = [
                _Hit(i, units, n, c)
                for i, units, n, c in zip(todo, reply["units"], reply["lengths"], reply["sums"])
                if units
            ]
            try:
                self._read(peer, hits, items, out)
            finally:
                self._request(peer, {"type": "release", "keys": keys})
        with self._lock:
            self.stats.loads += sum(out)
            self.stats.load_failures += len(out) - sum(out)
        return out

    def _read(self, peer: _Peer, hits: list[_Hit], items: ChunkItems, out: list[bool]) -> None:
        """Read the peer's leased units into reserved local units (their payloads only),
        verify the checksums, decode into the items' chunks."""
        local: list[tuple[_Hit, list[int]]] = []
        for h in hits:
            units = self.store.reserve(h.length)
            if units is not None and len(units) == len(h.units):
                local.append((h, units))
            elif units is not None:
                self.store.abandon(units)  # the peer's unit size differs: refused at connect
        if not local:
            return
        with self._backend_lock:
            handle = self.backend.read_blocks(
                peer.name,
                [u for _, units in local for u in units],
                [u for h, _ in local for u in h.units],
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
            for _, units in local:
                self.store.abandon(units)
            self._down(peer, f"read {state if state != 'PROC' else 'timed out'}")
            return
        corrupted = 0
        wire = 0
        for h, units in local:  # verify, decode, then index (served onward)
            key, dst = items[h.index]
            wire += len(units) * self.store.unit_bytes
            payload = self.store.read(units, h.length)
            if xxhash.xxh3_64_intdigest(payload) != h.checksum or not self._decode(payload, dst):
                corrupted += 1
                self.store.abandon(units)
                continue
            self.store.commit(key, units, h.length, h.checksum)
            out[h.index] = True
        with self._lock:
            self.stats.bytes_read += wire
            self.stats.corrupted += corrupted
        if corrupted:
            _warn(
                "p2p-corrupt",
                "%s: %d chunks from %s:%d failed their checksum or codec",
                self.name,
                corrupted,
                peer.host,
                peer.port,
            )

    def _decode(self, payload: bytes, dst: memoryview) -> bool:
        """Restore a chunk into ``dst``; False for a payload that is not one of this size."""
        if self.codec is None:
            if len(payload) != dst.nbytes:
                return False
            dst[:] = payload
            return True
        try:
            self.codec.decode(payload, dst)
        except CodecError:
            return False
        return True

    def store_batch(self, items: ChunkItems) -> list[bool]:
        """Keep a copy of this instance's chunks for its peers (nothing to do when not serving)."""
        if not self.serving:
            return [False] * len(items)
        out, written = [], 0
        for k, d in items:  # encoded here, on a tier I/O thread
            ok = d.nbytes == self.chunk_bytes
            payload = self.codec.encode(d) if ok and self.codec is not None else d
            ok = ok and self.store.put(k, payload)
            written += memoryview(payload).nbytes if ok else 0
            out.append(ok)
        with self._lock:
            self.stats.stores += sum(out)
            self.stats.store_failures += len(out) - sum(out)
            self.stats.bytes_written += written
            self.stats.usage_bytes = self.store.stored_bytes()
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
    for name in (
        "version",
        "fingerprint",
        "hash_seed",
        "chunk_bytes",
        "codec",
        "unit_bytes",
        "backend",
    ):
        if local.get(name) != remote.get(name):
            hint = (
                " (ensure PYTHONHASHSEED and the hash algorithm match)"
                if name == "hash_seed"
                else ""
            )
            return f"{name} differs (local {local.get(name)!r}, peer {remote.get(name)!r}){hint}"
    return None


__all__ = ["ChunkStore", "MEDIUM_P2P", "P2PTier", "compat_error"]
