"""The handshake side channel of the PD connectors (vLLM's NIXL side channel, over ZMQ).

Every instance with a `NixlConnector` listens on ``kv_ip:side_channel_port`` (a ZMQ ROUTER on a
daemon thread that reads an immutable payload, and answers the connector's own queries, such as
``staged:<request id>`` for compressed transfers). A peer that wants to read from (or write
to) it sends ``b"get_meta_msg"`` and gets the msgpack of its `KVAgentMetadata`: who it is
(engine id), how to reach its KV memory (the transfer backend's metadata) and everything two
engines must agree on before exchanging blocks. `check_compatible` refuses a peer with a
`HandshakeError` naming the first field that differs: model (the weights' identity), hash seed
(how block hashes are computed), block size, KV dtype, layout, block length, transfer codec,
backend.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import msgspec
import zmq

logger = logging.getLogger(__name__)

HANDSHAKE_REQUEST = b"get_meta_msg"
PD_PROTOCOL_VERSION = 1
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0


class HandshakeError(ValueError):
    """A peer could not be reached, or is not compatible (the message names the field)."""


@dataclass(frozen=True, slots=True)
class KVAgentMetadata:
    engine_id: str
    backend: str  # transfer backend kind: "nixl" or "tcp"
    agent_metadata: bytes  # `KVTransferBackend.get_agent_metadata`
    model: str  # `models.loader.model_identity` of the weights
    hash_seed: str  # block-hash algorithm and NONE_HASH seed
    block_size: int
    kv_dtype: str
    kv_cache_layout: str
    num_blocks: int
    block_lens: tuple[int, ...]  # bytes per block of each registered region
    version: int = PD_PROTOCOL_VERSION
    # Tensor / decode context parallel sizes: a transfer moves every rank's blocks, rank r's
    # into rank r's, so both engines must be split alike (heterogeneous TP is refused).
    tp_size: int = 1
    dcp_size: int = 1
    # Compressed transfers (`kv_transfer.staging`): the codec both engines use ("raw": none)
    # and the backend metadata of this engine's staging agent.
    transfer_codec: str = "raw"
    staging_agent_metadata: bytes = b""

    def encode(self) -> bytes:
        d = asdict(self)
        d["block_lens"] = list(self.block_lens)
        return msgspec.msgpack.encode(d)

    @classmethod
    def decode(cls, data: bytes) -> KVAgentMetadata:
        try:
            d = msgspec.msgpack.decode(data)
            names = {f.name for f in fields(cls)}
            d = {k: v for k, v in d.items() if k in names}
            d["block_lens"] = tuple(d["block_lens"])
            return cls(**d)
        except Exception as e:  # any malformed payload is a handshake failure
            raise HandshakeError(f"malformed handshake payload: {e}") from None


# Checked in this order; the first mismatch is reported.
_COMPAT_FIELDS = (
    "version",
    "model",
    "hash_seed",
    "block_size",
    "kv_dtype",
    "kv_cache_layout",
    "tp_size",
    "dcp_size",
    "block_lens",
    "transfer_codec",
    "backend",
)


def check_compatible(
    local: KVAgentMetadata, remote: KVAgentMetadata, expected_engine_id: str | None = None
) -> None:
    """Raise `HandshakeError` naming the first field on which the engines disagree."""
    if expected_engine_id is not None and remote.engine_id != expected_engine_id:
        raise HandshakeError(
            f"engine_id mismatch: expected {expected_engine_id!r}, the peer is "
            f"{remote.engine_id!r} (is the side-channel host/port right?)"
        )
    for name in _COMPAT_FIELDS:
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            raise HandshakeError(
                f"peer {remote.engine_id} is incompatible: {name} differs "
                f"(local {mine!r}, remote {theirs!r})"
            )


class SideChannelListener:
    """Answers handshake requests on ``tcp://host:port`` with ``payload`` until `close`; a
    message that starts with a key of ``queries`` is answered by that function of the rest (on
    the listener thread: it must be thread-safe and quick)."""

    def __init__(
        self,
        host: str,
        port: int,
        payload: bytes,
        queries: dict[bytes, Callable[[bytes], bytes]] | None = None,
    ) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(
                f"cannot listen for KV handshakes on {host}:{port}: {e} "
                "(set kv_connector_extra_config.side_channel_port or --kv-side-channel-port)"
            ) from None
        self.host, self.port = host, port
        self._payload = payload
        self._queries = dict(queries or {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            ident, msg = frames[0], frames[-1]
            if msg == HANDSHAKE_REQUEST:
                self._sock.send_multipart([ident, b"", self._payload])
            elif (query := self._query(msg)) is not None:
                self._sock.send_multipart([ident, b"", query])
            else:
                logger.warning("side channel: unknown message %r", msg[:32])
                self._sock.send_multipart([ident, b"", b""])
        self._sock.close()

    def _query(self, msg: bytes) -> bytes | None:
        for prefix, fn in self._queries.items():
            if msg.startswith(prefix):
                try:
                    return fn(msg[len(prefix) :])
                except Exception:  # noqa: BLE001 - a failing query must not kill the listener
                    logger.exception("side channel: query %r failed", prefix)
                    return b""
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


def fetch_agent_metadata(
    host: str, port: int, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
) -> KVAgentMetadata:
    """Ask the peer at ``host:port`` for its metadata; `HandshakeError` if it does not answer in
    ``timeout_s`` (a dead or absent peer never blocks longer)."""
    reply = side_channel_request(host, port, HANDSHAKE_REQUEST, timeout_s, "the handshake")
    if not reply:
        raise HandshakeError(f"KV peer {host}:{port} refused the handshake")
    return KVAgentMetadata.decode(reply)


def side_channel_request(
    host: str, port: int, msg: bytes, timeout_s: float, what: str = "the query"
) -> bytes:
    """One request to the side channel at ``host:port``, its reply (empty: refused or failed);
    `HandshakeError` naming ``what`` when nothing answers within ``timeout_s``."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msg)
        return sock.recv()
    except zmq.ZMQError as e:
        raise HandshakeError(
            f"KV peer {host}:{port} did not answer {what} within {timeout_s:g} s ({e})"
        ) from None
    finally:
        sock.close()
