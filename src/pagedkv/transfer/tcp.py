"""`TcpBackend`: pure-Python `KVTransferBackend` over ZMQ, for machines where NIXL cannot import.

Each agent runs a ROUTER server thread on a free port. Messages are multipart
``[op, sender, header(msgpack), *one frame per region]``:

* ``READ {ids}``: the server replies ``OK`` with, per region, the requested blocks concatenated;
  the client scatters them into its memory, then sends ``NOTIF`` (so the peer hears of the read
  only after the data landed, as with NIXL).
* ``WRITE {ids, notif}``: the server scatters the frames into its memory, then queues ``notif``.
* ``NOTIF {notif}``: queued for `get_new_notifs`.

Every request is acknowledged; the client runs it on a worker thread with one deadline
(``timeout_s``), so `read_blocks` / `write_blocks` return at once and a dead peer ends ``"ERR"``.

Same-host fast path: when the peer's pid answers ``process_vm_readv`` with the random nonce it
advertised (so it is the same process, not a pid from another namespace), blocks move with
``process_vm_readv`` / ``process_vm_writev`` (one copy, no sockets); the notif still goes over
ZMQ. ``EPERM`` (ptrace restrictions) switches that peer back to TCP.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from pagedkv.transfer.base import KVTransferBackend, MemoryRegion, XferState

# Shared region helpers; importing nixl.py is safe without NIXL (it imports nixl_cu12 lazily).
from pagedkv.transfer.nixl import check_regions_pair, regions_from_wire, regions_to_wire

logger = logging.getLogger(__name__)

_OK, _ERR = b"OK", b"ERR"
_IOV_MAX = 1024  # Linux UIO_MAXIOV: iovecs per process_vm_* call


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc_vm() -> tuple[object, object] | None:
    """``(process_vm_readv, process_vm_writev)`` from libc, or None where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fns = libc.process_vm_readv, libc.process_vm_writev
    except (OSError, AttributeError):
        return None
    for fn in fns:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.POINTER(_Iovec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
    return fns


_VM = _libc_vm()


def vm_copy(write: bool, pid: int, pairs: Sequence[tuple[int, int, int]]) -> None:
    """Copy ``(local_addr, remote_addr, n)`` pairs from (``write=False``) or to process ``pid``.
    Raises OSError with the errno (EPERM, ESRCH, EFAULT) or on a short copy."""
    if _VM is None:
        raise OSError(38, "process_vm_readv unavailable")
    fn = _VM[1] if write else _VM[0]
    for start in range(0, len(pairs), _IOV_MAX):
        chunk = pairs[start : start + _IOV_MAX]
        local = (_Iovec * len(chunk))(*[_Iovec(a, n) for a, _, n in chunk])
        remote = (_Iovec * len(chunk))(*[_Iovec(r, n) for _, r, n in chunk])
        want = sum(n for _, _, n in chunk)
        got = fn(pid, local, len(chunk), remote, len(chunk), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        if got != want:
            raise OSError(5, f"short process_vm copy: {got} of {want} bytes")


def gather(region: MemoryRegion, block_ids: Sequence[int]) -> bytearray:
    """The blocks' bytes, concatenated in ``block_ids`` order."""
    n = region.block_len
    out = bytearray(n * len(block_ids))
    dst = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out)) if out else 0
    for i, b in enumerate(block_ids):
        ctypes.memmove(dst + i * n, region.block_addr(b), n)
    return out


def scatter(region: MemoryRegion, block_ids: Sequence[int], data: memoryview | bytes) -> None:
    """Inverse of `gather`: ``data`` must hold exactly ``len(block_ids)`` blocks."""
    n = region.block_len
    if len(data) != n * len(block_ids):
        raise ValueError(f"got {len(data)} bytes for {len(block_ids)} blocks of {n}")
    if not block_ids:
        return
    src = np.frombuffer(data, dtype=np.uint8).ctypes.data  # address of a read-only buffer
    for i, b in enumerate(block_ids):
        ctypes.memmove(region.block_addr(b), src + i * n, n)


def ids_valid(regions: Sequence[MemoryRegion], block_ids: Sequence[int]) -> bool:
    return all(0 <= b < r.num_blocks for r in regions for b in block_ids)


@dataclass(slots=True)
class _Peer:
    endpoint: str
    pid: int
    nonce_addr: int
    nonce: bytes
    regions: list[MemoryRegion]
    fast: bool  # process_vm_* works on this peer


@dataclass(slots=True)
class _Xfer:
    peer: str
    deadline: float
    future: Future[XferState] | None  # None: finished at start
    state: XferState = "PROC"


@dataclass(slots=True)
class _State:
    regions: list[MemoryRegion] = field(default_factory=list)
    peers: dict[str, _Peer] = field(default_factory=dict)
    xfers: dict[int, _Xfer] = field(default_factory=dict)
    notifs: dict[str, list[bytes]] = field(default_factory=dict)  # guarded by notif_lock
    closed: bool = False


class TcpBackend(KVTransferBackend):
    """Agent ``name`` serving on ``host`` (a free port); every request bounded by ``timeout_s``."""

    kind = "tcp"

    def __init__(
        self,
        name: str,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = 10.0,
        num_threads: int = 4,
        fast_path: bool = True,
    ) -> None:
        super().__init__(name)
        self.host, self.timeout_s, self.fast_path = host, timeout_s, fast_path
        self._s = _State()
        self._ids = itertools.count(1)
        self._notif_lock = threading.Lock()
        # The nonce lives in our memory: a peer reading it back proves it reached this process.
        self._nonce = ctypes.create_string_buffer(secrets.token_bytes(16), 16)
        self._ctx = zmq.Context()
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        self.port = self._server.bind_to_random_port(f"tcp://{host}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kv-tcp-{name}", daemon=True)
        self._thread.start()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix=f"kv-tcp-{name}")
        self._notif_pool = ThreadPoolExecutor(1)  # one thread: control messages stay in order

    # -- registration and peers ------------------------------------------------------------

    def register_kv_memory(self, regions: Sequence[MemoryRegion]) -> None:
        if self._s.regions:
            raise RuntimeError("register_kv_memory called twice")
        if not regions:
            raise ValueError("no KV regions to register")
        self._s.regions = list(regions)

    def get_agent_metadata(self) -> bytes:
        if not self._s.regions:
            raise RuntimeError("register_kv_memory must be called before get_agent_metadata")
        return msgspec.msgpack.encode(
            {
                "name": self.name,
                "host": self.host,
                "port": self.port,
                "pid": os.getpid(),
                "nonce_addr": ctypes.addressof(self._nonce),
                "nonce": self._nonce.raw,
                "regions": regions_to_wire(self._s.regions),
            }
        )

    def add_remote_agent(self, metadata: bytes) -> str:
        md = msgspec.msgpack.decode(metadata)
        regions = regions_from_wire(md["regions"])
        check_regions_pair(self._s.regions, regions, md["name"])
        fast = self.fast_path and self._probe_fast(md["pid"], md["nonce_addr"], md["nonce"])
        self._s.peers[md["name"]] = _Peer(
            f"tcp://{md['host']}:{md['port']}",
            md["pid"],
            md["nonce_addr"],
            md["nonce"],
            regions,
            fast,
        )
        return md["name"]

    def uses_fast_path(self, peer: str) -> bool:
        """Whether blocks to/from ``peer`` move by process_vm_* (else over ZMQ)."""
        return self._peer(peer).fast

    @staticmethod
    def _read_remote(pid: int, addr: int, n: int) -> bytes:
        """``n`` bytes at ``addr`` in process ``pid`` (OSError as `vm_copy`)."""
        buf = ctypes.create_string_buffer(n)
        vm_copy(False, pid, [(ctypes.addressof(buf), addr, n)])
        return buf.raw

    @classmethod
    def _probe_fast(cls, pid: int, addr: int, nonce: bytes) -> bool:
        try:
            return cls._read_remote(pid, addr, len(nonce)) == nonce
        except OSError:  # other host, other pid namespace, EPERM: use TCP
            return False

    def remove_remote_agent(self, peer: str) -> None:
        if self._s.peers.pop(peer, None) is None:
            return
        for x in self._s.xfers.values():
            if x.peer == peer and x.state == "PROC":
                x.state = "ERR"  # its worker finishes within the deadline; the result is ignored

    # -- transfers ---------------------------------------------------------------------------

    def read_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes = b"",
    ) -> int:
        return self._start(False, peer, local_block_ids, remote_block_ids, notif)

    def write_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes = b"",
    ) -> int:
        return self._start(True, peer, local_block_ids, remote_block_ids, notif)

    def _start(
        self,
        write: bool,
        peer: str,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        notif: bytes,
    ) -> int:
        p = self._peer(peer)
        if len(local_ids) != len(remote_ids):
            raise ValueError(f"{len(local_ids)} local vs {len(remote_ids)} remote block ids")
        local_ids, remote_ids = [int(b) for b in local_ids], [int(b) for b in remote_ids]
        handle = next(self._ids)
        deadline = time.monotonic() + self.timeout_s
        x = _Xfer(peer, deadline, None)
        self._s.xfers[handle] = x
        if not ids_valid(self._s.regions, local_ids) or not ids_valid(p.regions, remote_ids):
            logger.warning("KV transfer to %s: block id out of range", peer)
            x.state = "ERR"
        elif not local_ids and not notif:
            x.state = "DONE"
        else:
            x.future = self._pool.submit(
                self._run, write, p, local_ids, remote_ids, notif, deadline
            )
        return handle

    def _run(
        self,
        write: bool,
        p: _Peer,
        local_ids: list[int],
        remote_ids: list[int],
        notif: bytes,
        deadline: float,
    ) -> XferState:
        """Worker thread: move the blocks, then make sure the notif reached the peer."""
        try:
            if local_ids and p.fast and self._try_fast(write, p, local_ids, remote_ids):
                return self._notify(p, notif, deadline)
            if not local_ids:
                return self._notify(p, notif, deadline)
            if write:
                frames = [gather(r, local_ids) for r in self._s.regions]
                reply = self._request(
                    p, b"WRITE", {"ids": remote_ids, "notif": notif}, frames, deadline
                )
                return "DONE" if reply is not None else "ERR"
            reply = self._request(p, b"READ", {"ids": remote_ids}, [], deadline)
            if reply is None or len(reply) != len(self._s.regions):
                return "ERR"
            for region, frame in zip(self._s.regions, reply):
                scatter(region, local_ids, frame.buffer)
            return self._notify(p, notif, deadline)
        except Exception as e:  # any failure is this transfer's ERR, never the engine's crash
            logger.warning("KV transfer to %s failed: %s", p.endpoint, e)
            return "ERR"

    def _try_fast(self, write: bool, p: _Peer, local_ids: list[int], remote_ids: list[int]) -> bool:
        """Copy with process_vm_*; False if this peer must use TCP. Other errors raise."""
        pairs = [
            (lo.block_addr(a), ro.block_addr(b), lo.block_len)
            for lo, ro in zip(self._s.regions, p.regions)
            for a, b in zip(local_ids, remote_ids)
        ]
        try:
            # Re-check the nonce first: if the peer died and its pid was reused, we must not
            # read (let alone write) another process's memory.
            if self._read_remote(p.pid, p.nonce_addr, len(p.nonce)) != p.nonce:
                raise OSError(3, f"peer pid {p.pid} no longer holds its nonce (peer gone)")
            vm_copy(write, p.pid, pairs)
        except OSError as e:
            if e.errno != 1:  # EPERM only: ESRCH (dead peer) or EFAULT are real failures
                raise
            logger.info("process_vm_* refused (EPERM) for %s: using TCP", p.endpoint)
            p.fast = False
            return False
        return True

    def _notify(self, p: _Peer, notif: bytes, deadline: float) -> XferState:
        if not notif:
            return "DONE"
        return (
            "DONE"
            if self._request(p, b"NOTIF", {"notif": notif}, [], deadline) is not None
            else "ERR"
        )

    def _request(
        self,
        p: _Peer,
        op: bytes,
        header: dict[str, object],
        frames: list[bytearray],
        deadline: float,
    ) -> list[zmq.Frame] | None:
        """One request/reply on a fresh DEALER socket; the reply's data frames, or None on ERR or
        timeout. A fresh socket per request: ZMQ sockets are not thread-safe, and a timed-out
        socket must not deliver its late reply to the next request."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(p.endpoint)
            sock.send_multipart(
                [op, self.name.encode(), msgspec.msgpack.encode(header), *frames], copy=False
            )
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not sock.poll(wait_ms, zmq.POLLIN):
                logger.warning("KV %s to %s timed out", op.decode(), p.endpoint)
                return None
            reply = sock.recv_multipart(copy=False)
            if reply[0].bytes != _OK:
                logger.warning(
                    "KV %s to %s refused: %s",
                    op.decode(),
                    p.endpoint,
                    reply[1].bytes.decode(errors="replace") if len(reply) > 1 else "",
                )
                return None
            return reply[1:]
        finally:
            sock.close(0)

    def check_xfer_state(self, handle: int) -> XferState:
        x = self._s.xfers[handle]
        if x.state != "PROC":
            return x.state
        assert x.future is not None
        if x.future.done():
            x.state = x.future.result()
        elif (
            time.monotonic() > x.deadline + 1.0
        ):  # the worker's own wait is bounded; belt and braces
            x.state = "ERR"
        return x.state

    def release_xfer(self, handle: int) -> None:
        self._s.xfers.pop(handle, None)  # a still-running worker ends by its deadline

    # -- notifications ---------------------------------------------------------------------------

    def send_notif(self, peer: str, msg: bytes) -> None:
        p = self._peer(peer)
        self._notif_pool.submit(self._notify, p, msg, time.monotonic() + self.timeout_s)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        with self._notif_lock:
            out, self._s.notifs = self._s.notifs, {}
        return out

    def _peer(self, peer: str) -> _Peer:
        p = self._s.peers.get(peer)
        if p is None:
            raise ValueError(f"unknown peer {peer!r}: add_remote_agent first")
        return p

    # -- server thread --------------------------------------------------------------------------

    def _serve(self) -> None:
        """ROUTER loop; polls with a short timeout so `shutdown` stops it promptly."""
        while not self._stop.is_set():
            try:
                if not self._server.poll(100, zmq.POLLIN):
                    continue
                msg = self._server.recv_multipart(copy=False)
            except zmq.ZMQError:
                return  # socket closed under us by shutdown
            ident, body = msg[0], msg[1:]
            try:
                reply = self._handle(body)
            except Exception as e:  # a bad request is answered, never kills the server
                reply = [_ERR, str(e).encode()]
            try:
                self._server.send_multipart([ident, *reply], copy=False)
            except zmq.ZMQError:
                return

    def _handle(self, body: list[zmq.Frame]) -> list[bytes | bytearray]:
        op, sender = body[0].bytes, body[1].bytes.decode()
        header = msgspec.msgpack.decode(body[2].bytes)
        if op == b"NOTIF":
            self._queue_notif(sender, header["notif"])
            return [_OK]
        regions = self._s.regions
        ids = [int(b) for b in header["ids"]]
        if not regions or not ids_valid(regions, ids):
            return [_ERR, b"block id out of range or no registered memory"]
        if op == b"READ":
            return [_OK, *[gather(r, ids) for r in regions]]
        if op == b"WRITE":
            data = body[3:]
            if len(data) != len(regions):
                return [_ERR, b"one frame per region expected"]
            for region, frame in zip(regions, data):
                scatter(region, ids, frame.buffer)
            if header.get("notif"):
                self._queue_notif(sender, header["notif"])  # after the data landed
            return [_OK]
        return [_ERR, b"unknown op " + op]

    def _queue_notif(self, sender: str, notif: bytes) -> None:
        with self._notif_lock:
            self._s.notifs.setdefault(sender, []).append(bytes(notif))

    # -- teardown ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._s.closed:
            return
        self._s.closed = True
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._pool.shutdown(wait=True, cancel_futures=True)  # workers end by their deadlines
        self._notif_pool.shutdown(wait=True, cancel_futures=True)
        self._server.close(0)
        self._ctx.term()
        self._s.peers.clear()
        self._s.xfers.clear()
