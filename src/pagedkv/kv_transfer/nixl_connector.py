"""`NixlConnector`: prefill/decode disaggregation over a `KVTransferBackend` (NIXL, or the TCP
fallback), vLLM's connector name and protocol (``pd-disaggregation.md`` §3-4).

Roles (``kv_role``): a producer (``kv_producer``, the prefill instance) computes a prompt's KV
and hands it over; a consumer (``kv_consumer``, the decode instance) continues from it;
``kv_both`` does either, per request. Per-request ``kv_transfer_params`` select the part:

* **producer** — a request with ``do_remote_decode: true`` (the proxy sends it with
  ``max_tokens=1``) finishes normally, but its blocks stay allocated (delayed free) and its
  output carries ``kv_transfer_params``: ``do_remote_prefill``, ``remote_engine_id``,
  ``remote_block_ids``, ``remote_host``, ``remote_port`` (this side channel),
  ``remote_request_id``, ``remote_num_tokens``, ``transfer_mode``. The blocks are freed when the
  consumer reports it is done, or when the request's lease expires (``kv_lease_duration``,
  default 30 s, extended by the consumer's heartbeats while its transfer is pending).
* **consumer** — a request with ``do_remote_prefill: true`` and those fields is admitted with
  blocks for its whole prompt, parks in ``WAITING_FOR_REMOTE_KVS``, and fetches only the blocks
  after its own local prefix hit. *Pull* (default): it reads them, the notification attached to
  the read tells the producer to free. *Push* (``transfer_mode: "push"``): it registers its
  block ids with the producer, which writes into them and notifies; a push that does not arrive
  within ``push_timeout_s`` (default 30 s) fails over to local recompute. When the KV has
  arrived the request recomputes only its last prompt token (whose logits give the next token).

Failures never lose a request: a peer that is unreachable, refuses the handshake (model, hash
seed, block size, dtype, layout differ: `side_channel.check_compatible`) or fails a transfer
makes the consumer report the request's blocks invalid, and the scheduler recomputes them
(``kv_load_failure_policy: "recompute"``, the default) or fails the request (``"fail"``).

``kv_connector_extra_config``: ``side_channel_port`` (default ``kv_port``), ``backend``
(``"nixl"``, ``"tcp"``; default: NIXL when it imports), ``transfer_mode`` (``"pull"`` or
``"push"``: what this producer offers), ``kv_lease_duration``, ``push_timeout_s``,
``handshake_timeout_s``, ``transfer_timeout_s``, ``nixl_progress_thread`` (default on: a peer
that is not being polled still serves reads; off, transfers wait for the peer's next engine
step), ``nixl_progress_delay_us`` (the progress thread's sleep between polls, default 100:
NIXL's own 0 is a busy loop that took a core from the engine on a CPU-only host),
``tcp_fast_path`` (default on: the TCP backend copies with ``process_vm_readv`` on one host;
off, it always uses its sockets), ``transfer_codec`` (``raw``, ``zstd``, ``lz4``, ``int8``: KV
travels in encoded frames, `kv_transfer.staging`; both engines must name the same one, pull
only) and ``transfer_staging_mib`` (the staging area for frames, default 256; a request whose
frames do not fit is served raw).

KV events (`take_events`): a consumer reports each completed read as one ``BlockStored`` with
medium ``REMOTE`` (the full blocks that arrived: hashes, parent, tokens). It is a *transfer
record*, not a residency claim: the blocks are in this engine's own pool from then on (and its
pool reports them with its own medium when it caches them), so KV-aware routers skip
``REMOTE`` (media not local to the replica).

The handshake runs on a background thread (a dead peer never stalls the engine); the backend is
used only from the engine thread (NIXL is not thread-safe).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from pagedkv.core.events import MEDIUM_REMOTE, BlockStored
from pagedkv.core.hashing import maybe_convert_block_hash
from pagedkv.core.request import KVCacheRequest, RequestStatus
from pagedkv.core.specs import KVQuantMode
from pagedkv.core.units import cdiv
from pagedkv.kv_transfer.base import (
    BlockIds,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from pagedkv.kv_transfer.config import KVTransferConfig
from pagedkv.kv_transfer.side_channel import (
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    HandshakeError,
    KVAgentMetadata,
    SideChannelListener,
    check_compatible,
    fetch_agent_metadata,
    side_channel_request,
)
from pagedkv.kv_transfer.staging import (
    DEFAULT_STAGING_MIB,
    STAGED_PREFIX,
    Frame,
    StagingArea,
    decode_blocks,
    encode_blocks,
    free_frames,
    layout_reply,
    parse_layout,
    slots_of,
)
from pagedkv.kv_transfer.stats import KVConnectorStats, KVTransferStats
from pagedkv.offload.codec import KVCodec, make_codec
from pagedkv.offload.sharded import RankShardInfo, check_same_host, map_kv_buffer
from pagedkv.transfer import get_transfer_backend
from pagedkv.transfer.base import KVTransferBackend, MemoryRegion

if TYPE_CHECKING:
    from pagedkv.core.specs import KVCacheConfig

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
DEFAULT_PUSH_TIMEOUT_S = 30.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
# Notification prefixes (bytes on the backend's notification channel).
DONE, HEARTBEAT, PUSH_REG, PUSHED = b"done:", b"HB:", b"PUSH_REG:", b"pushed:"


def _started_key(p: dict[str, Any]) -> tuple[str, str]:
    """The key of a consumer's read: request ids are unique per producer, not across them."""
    return (str(p.get("remote_engine_id")), str(p.get("remote_request_id")))


_REQUIRED_PARAMS = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id")


@dataclass(slots=True)
class RecvReq:
    """A consumer request's KV to fetch: our blocks from ``first_block`` on, the producer's
    matching blocks (None in push mode: the producer knows its own)."""

    request_id: str
    remote_request_id: str
    engine_id: str
    host: str
    port: int
    first_block: int
    local_block_ids: list[int]
    remote_block_ids: list[int] | None
    mode: str = "pull"
    handle: int | None = None  # the backend transfer in flight (pull)
    deadline: float = 0.0  # give up (transfer or push) after this monotonic time
    started: float = 0.0
    # A compressed read (`kv_transfer.staging`): its stage ("layout", "alloc", "read",
    # "decode"; "" otherwise), the layout query or decode in flight, the frames to read and
    # where they land in our staging area.
    stage: str = ""
    future: Future | None = None
    frames: list[Frame] = field(default_factory=list)
    staging_slot: int | None = None

    @property
    def num_staging_slots(self) -> int:
        return sum(f.num_slots for f in self.frames)


@dataclass(slots=True)
class SendReq:
    """A producer request whose blocks are held for a consumer until ``expiry``."""

    request_id: str
    block_ids: list[int]
    expiry: float
    push_handle: int | None = None
    push_started: float = 0.0


@dataclass(slots=True)
class NixlConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: dict[str, RecvReq] = field(default_factory=dict)
    # Consumer requests that finished before fetching: tell their producers to free.
    early_frees: list[RecvReq] = field(default_factory=list)


@dataclass(slots=True)
class _Peer:
    name: str | None = None  # the backend's peer name once connected
    staging_name: str | None = None  # its staging agent's, with a transfer codec
    future: Future | None = None  # the handshake in flight
    error: str | None = None


class NixlConnector(KVConnectorBase):
    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        model_identity: str = "",
        hash_seed: str = "",
    ) -> None:
        super().__init__(
            config, role, kv_cache_config, model_identity=model_identity, hash_seed=hash_seed
        )
        if kv_cache_config is None:
            raise ValueError("the NixlConnector needs the KV cache config")
        self.check_kv_cache_groups(kv_cache_config.kv_cache_groups)
        extra = config.get_from_extra_config
        self.engine_id: str = config.engine_id  # type: ignore[assignment]
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.host = config.kv_ip
        self.port = int(extra("side_channel_port", config.kv_port))
        self.transfer_mode = extra("transfer_mode", "pull")
        if self.transfer_mode not in ("pull", "push"):
            raise ValueError(f"invalid transfer_mode {self.transfer_mode!r}: use 'pull' or 'push'")
        self.lease_s = float(extra("kv_lease_duration", DEFAULT_LEASE_S))
        self.push_timeout_s = float(extra("push_timeout_s", DEFAULT_PUSH_TIMEOUT_S))
        self.handshake_timeout_s = float(extra("handshake_timeout_s", DEFAULT_HANDSHAKE_TIMEOUT_S))
        self.transfer_timeout_s = float(extra("transfer_timeout_s", DEFAULT_TRANSFER_TIMEOUT_S))
        self._backend_name = extra("backend")
        self.codec = self._make_codec(kv_cache_config, str(extra("transfer_codec", "raw")))
        self.staging_bytes = int(float(extra("transfer_staging_mib", DEFAULT_STAGING_MIB)) * 2**20)
        self.staging: StagingArea | None = None
        self.staging_backend: KVTransferBackend | None = None
        # Producer: each held request's frames, "pending" while encoding, "raw" if they did not
        # fit (read by the side channel's thread: under the lock).
        self._staged: dict[str, list[Frame] | str] = {}
        self._staged_lock = threading.Lock()
        self._codec_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-codec")
        self._layout_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-layout")
        self._regions: list[MemoryRegion] = []
        # scheduler side
        self._pending_recv: dict[str, RecvReq] = {}
        self._early_frees: list[RecvReq] = []
        # (producer engine id, its request id) already fetched or given up: request ids are only
        # unique within one producer (an `LLM`'s are a counter), so the engine id is part of it.
        self._recv_started: set[tuple[str, str]] = set()
        # KV events: a record per read in flight (its local blocks, its event), then the events.
        self._recv_records: dict[str, tuple[list[int], BlockStored]] = {}
        self._events: list[BlockStored] = []
        # worker side
        self.backend: KVTransferBackend | None = None
        self.local_meta: KVAgentMetadata | None = None
        self._listener: SideChannelListener | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-handshake")
        self._peers: dict[tuple[str, str, int], _Peer] = {}
        self._waiting_peer: dict[str, RecvReq] = {}  # handshake pending
        self._recving: dict[str, RecvReq] = {}  # transfer in flight, or push awaited
        self._sending: dict[str, SendReq] = {}  # producer: blocks held (by our request id)
        # Push registrations by our request id, with when they arrived (one may come before the
        # request finished; one for a request never seen is dropped after push_timeout_s).
        self._push_regs: dict[str, tuple[dict[str, Any], float]] = {}
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._bytes_per_block = 0
        self._last_heartbeat = 0.0
        self._rank_buffers: list[Any] = []  # ranks 1..N-1's KV buffers, mapped (TP)
        self._dcp_size = 1
        self.xfer_stats = KVTransferStats(role=config.kv_role or "")

    def _make_codec(self, kv_cache_config: KVCacheConfig, name: str) -> KVCodec | None:
        """The ``transfer_codec`` for this cache (None: raw transfers); ValueError if it does
        not fit (the lossy one over quantized pages) or is asked for with push transfers."""
        if name == "raw":
            return None
        if self.transfer_mode == "push":
            raise ValueError("transfer_codec needs transfer_mode 'pull' (the consumer decodes)")
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        mode = getattr(spec, "kv_quant_mode", KVQuantMode.NONE)
        return make_codec(name, spec.dtype, spec.head_size, mode is not KVQuantMode.NONE)

    @classmethod
    def check_kv_cache_groups(cls, kv_cache_groups: list[Any]) -> None:
        if len(kv_cache_groups) != 1:
            raise ValueError(
                "the NixlConnector supports models with one KV cache group; this model has "
                f"{len(kv_cache_groups)} (hybrid full + sliding-window attention)"
            )

    # ---- scheduler side ---------------------------------------------------------------------------

    def _remote(self, request: KVCacheRequest) -> dict[str, Any] | None:
        """The request's consumer params, if it is to fetch its KV (and has not yet)."""
        p = request.kv_transfer_params or {}
        if (
            not self.config.is_kv_consumer
            or not p.get("do_remote_prefill")
            or _started_key(p) in self._recv_started
        ):
            return None
        missing = [k for k in _REQUIRED_PARAMS if p.get(k) is None]
        if missing:
            logger.warning(
                "request %s: kv_transfer_params lack %s; computing its prompt locally",
                request.request_id,
                missing,
            )
            return None
        if p.get("transfer_mode", "pull") == "pull" and not p.get("remote_block_ids"):
            logger.warning(
                "request %s: no remote_block_ids; computing its prompt locally", request.request_id
            )
            return None
        n = p.get("remote_num_tokens")
        if n is not None and n != request.num_prompt_tokens:
            logger.warning(
                "request %s: the producer computed %s prompt tokens, this prompt has %d; "
                "computing it locally",
                request.request_id,
                n,
                request.num_prompt_tokens,
            )
            return None
        return p

    def get_num_new_matched_tokens(
        self, request: KVCacheRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.num_output_tokens or self._remote(request) is None:
            return 0, False
        ext = request.num_prompt_tokens - num_computed_tokens
        return (ext, True) if ext > 0 else (0, False)

    def update_state_after_alloc(
        self, request: KVCacheRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        p = self._remote(request) if num_external_tokens > 0 else None
        if p is None:
            return
        rrid = p["remote_request_id"]
        self._recv_started.add(_started_key(p))
        first = request.num_computed_tokens // self.block_size
        last = cdiv(request.num_prompt_tokens, self.block_size)
        mode = p.get("transfer_mode", "pull")
        remote = None
        if mode == "pull":
            remote = list(p["remote_block_ids"])[first:last]
        self._pending_recv[request.request_id] = RecvReq(
            request.request_id,
            rrid,
            p["remote_engine_id"],
            p["remote_host"],
            int(p["remote_port"]),
            first,
            list(block_ids[0][first:last]),
            remote,
            mode,
        )
        self._record_recv(request, list(block_ids[0][first:last]), first)

    def _record_recv(self, request: KVCacheRequest, local_ids: list[int], first: int) -> None:
        """The KV event of this read, kept until it completes (`update_connector_output`)."""
        full = min(request.num_prompt_tokens // self.block_size, len(request.block_hashes))
        if full <= first:
            return  # only a partial block moves: nothing content-addressed to report
        hashes = request.block_hashes
        bs = self.block_size
        self._recv_records[request.request_id] = (
            local_ids,
            BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:full]],
                parent_block_hash=maybe_convert_block_hash(hashes[first - 1])
                if first > 0
                else None,
                token_ids=list(request.all_token_ids[first * bs : full * bs]),
                block_size=bs,
                lora_id=None,
                medium=MEDIUM_REMOTE,
            ),
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Completed reads become KV events (failed ones, with invalid blocks, do not)."""
        for rid in connector_output.finished_recving:
            rec = self._recv_records.pop(rid, None)
            if rec is not None and not connector_output.invalid_block_ids.intersection(rec[0]):
                self._events.append(rec[1])

    def take_events(self) -> list[Any]:
        events, self._events = self._events, []
        return events

    def build_connector_meta(self, scheduler_output: Any) -> NixlConnectorMetadata:
        meta = NixlConnectorMetadata(self._pending_recv, self._early_frees)
        self._pending_recv, self._early_frees = {}, []
        return meta

    def request_finished(
        self, request: KVCacheRequest, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        p = request.kv_transfer_params or {}
        if p.get("do_remote_prefill") and _started_key(p) not in self._recv_started:
            consumer = self._remote(request)
            if consumer is not None:  # never fetched (aborted while queued): let the producer free
                self._recv_started.add(_started_key(consumer))
                self._early_frees.append(
                    RecvReq(
                        request.request_id,
                        consumer["remote_request_id"],
                        consumer["remote_engine_id"],
                        consumer["remote_host"],
                        int(consumer["remote_port"]),
                        0,
                        [],
                        None,
                    )
                )
        # Only sample 0 of an n > 1 request hands its prompt over (the samples share its blocks).
        if (
            not self.config.is_kv_producer
            or not p.get("do_remote_decode")
            or getattr(request, "sample_index", 0)
        ):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        ):
            return False, None  # aborted or failed: nothing to hand over
        blocks = list(block_ids[0][: cdiv(request.num_prompt_tokens, self.block_size)])
        self._sending[request.request_id] = SendReq(
            request.request_id, blocks, time.monotonic() + self.lease_s
        )
        if self.codec is not None:
            with self._staged_lock:
                self._staged[request.request_id] = "pending"
            self._codec_pool.submit(self._encode, request.request_id, blocks)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": blocks,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": request.request_id,
            "remote_num_tokens": request.num_prompt_tokens,
            "transfer_mode": self.transfer_mode,
        }

    def has_pending_work(self) -> bool:
        return bool(self._sending or self._recving or self._waiting_peer)

    # ---- tensor / decode context parallelism --------------------------------------------------------

    # The executor moves ranks 1..N-1's KV buffers to shared memory for this connector.
    needs_rank_kv_buffers = True

    def set_rank_shards(self, infos: list[RankShardInfo]) -> None:
        """Before `register_kv_caches`, on a TP/DCP engine's driver: map every other rank's KV
        buffer (shared memory on this host) so one agent registers every rank's blocks and a
        transfer moves all of them. Both engines must have the same ``tp_size`` and
        ``dcp_size`` (the handshake names the field otherwise); ranks elsewhere, or a CUDA
        cache, are refused (they would need an agent per rank)."""
        check_same_host(infos)
        missing = [i.rank for i in infos[1:] if i.kv_memory is None]
        if missing:
            raise ValueError(f"rank(s) {missing} did not share their KV buffers")
        self._rank_buffers = [map_kv_buffer(i.kv_memory) for i in infos[1:]]  # type: ignore[arg-type]
        self._dcp_size = infos[0].dcp_size

    # ---- worker side: setup -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any], kv_buffer: Any = None) -> None:
        super().register_kv_caches(kv_caches, kv_buffer)
        if kv_buffer is None:
            raise ValueError("the NixlConnector needs the contiguous KV buffer")
        layout = self.kv_cache_config.layout
        name = layout.name if hasattr(layout, "name") else str(layout)
        regions = [r for buf in [kv_buffer, *self._rank_buffers] for r in buffer_regions(buf, name)]
        self.backend = self._make_backend(self.engine_id)
        self.backend.register_kv_memory(regions)
        self._regions = regions
        staging_meta = b""
        if self.codec is not None:
            self.staging = StagingArea(self.staging_bytes)
            self.staging_backend = self._make_backend(f"{self.engine_id}-staging")
            self.staging_backend.register_kv_memory([self.staging.region])
            staging_meta = self.staging_backend.get_agent_metadata()
        spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.local_meta = KVAgentMetadata(
            engine_id=self.engine_id,
            backend=self.backend.kind,
            agent_metadata=self.backend.get_agent_metadata(),
            model=self.model_identity,
            hash_seed=self.hash_seed,
            block_size=self.block_size,
            kv_dtype=getattr(spec, "kv_format", str(spec.dtype)),
            kv_cache_layout=regions_layout_name(layout),
            num_blocks=self.kv_cache_config.num_blocks,
            block_lens=tuple(r.block_len for r in regions),
            tp_size=1 + len(self._rank_buffers),
            dcp_size=self._dcp_size,
            transfer_codec=self.codec.name if self.codec is not None else "raw",
            staging_agent_metadata=staging_meta,
        )
        self._bytes_per_block = sum(r.block_len for r in regions)
        self._listener = SideChannelListener(
            self.host,
            self.port,
            self.local_meta.encode(),
            {STAGED_PREFIX: self._staged_query},
        )
        logger.info(
            "NixlConnector %s (%s): side channel %s:%d, transfer backend %s",
            self.engine_id,
            self.config.kv_role,
            self.host,
            self.port,
            self.backend.kind,
        )

    def _make_backend(self, name: str) -> KVTransferBackend:
        extra = self.config.get_from_extra_config
        kw: dict[str, Any] = {}
        if self._backend_name == "tcp" and not extra("tcp_fast_path", True):
            kw["fast_path"] = False  # sockets even on one host (to measure the wire path)
        return get_transfer_backend(
            name,
            self._backend_name,
            nixl_progress_thread=bool(extra("nixl_progress_thread", True)),
            nixl_progress_delay_us=extra("nixl_progress_delay_us", None),
            **kw,
        )

    # ---- worker side: per step --------------------------------------------------------------------

    def start_load_kv(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, NixlConnectorMetadata)
        for req in meta.reqs_to_recv.values():
            self._waiting_peer[req.request_id] = req
            self._connect(req)
        for req in meta.early_frees:
            self._waiting_peer[f"early:{req.remote_request_id}"] = req
            self._connect(req)
        self._progress()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._progress()
        self._read_notifs()
        self._expire_leases()
        self._heartbeat()
        sending, recving = self._done_sending, self._done_recving
        self._done_sending, self._done_recving = set(), set()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- peers --------------------------------------------------------------------------------------

    def _connect(self, req: RecvReq) -> None:
        """Start the handshake with ``req``'s producer unless connected or connecting."""
        key = (req.engine_id, req.host, req.port)
        peer = self._peers.get(key)
        if peer is None or peer.error is not None:
            peer = self._peers[key] = _Peer(
                future=self._executor.submit(self._handshake, req.host, req.port, req.engine_id)
            )

    def _handshake(self, host: str, port: int, engine_id: str) -> KVAgentMetadata:
        """On the handshake thread: fetch and check the peer's metadata (no backend calls)."""
        remote = fetch_agent_metadata(host, port, self.handshake_timeout_s)
        check_compatible(self.local_meta, remote, expected_engine_id=engine_id)
        return remote

    def _peer_name(self, req: RecvReq) -> str | None:
        """The connected peer of ``req``, None while connecting; raises HandshakeError if failed."""
        peer = self._peers[(req.engine_id, req.host, req.port)]
        if peer.name is not None:
            return peer.name
        if peer.error is not None:
            raise HandshakeError(peer.error)
        if not peer.future.done():
            return None
        try:
            remote = peer.future.result()
            peer.name = self.backend.add_remote_agent(remote.agent_metadata)
            if self.staging_backend is not None:
                peer.staging_name = self.staging_backend.add_remote_agent(
                    remote.staging_agent_metadata
                )
        except Exception as e:  # noqa: BLE001 - any failure refuses the peer
            peer.error = str(e)
            logger.error("KV peer %s at %s:%d refused: %s", req.engine_id, req.host, req.port, e)
            raise HandshakeError(peer.error) from None
        return peer.name

    # ---- transfers ----------------------------------------------------------------------------------

    def _progress(self) -> None:
        """Start the transfers whose peer is ready; poll the ones in flight."""
        for key, req in list(self._waiting_peer.items()):
            try:
                name = self._peer_name(req)
            except HandshakeError:
                del self._waiting_peer[key]
                if not key.startswith("early:"):
                    self._fail(req)
                continue
            if name is None:
                continue
            del self._waiting_peer[key]
            if key.startswith("early:"):
                self.backend.send_notif(name, DONE + req.remote_request_id.encode())
            else:
                self._start_transfer(req, name)
        now = time.monotonic()
        for rid, req in list(self._recving.items()):
            if req.stage:
                self._progress_staged(req, now)
                continue
            if req.handle is None:  # push: waiting for the producer's write
                if now > req.deadline:
                    logger.error(
                        "request %s: the producer's push did not arrive within %.0f s; recomputing",
                        rid,
                        self.push_timeout_s,
                    )
                    del self._recving[rid]
                    self._fail(req)
                continue
            state = self.backend.check_xfer_state(req.handle)
            if state == "PROC" and now <= req.deadline:
                continue
            self.backend.release_xfer(req.handle)
            del self._recving[rid]
            if state == "DONE":
                self._done_recving.add(rid)
                self._record(req, len(req.local_block_ids))
            else:
                self._fail(req)

    def _record(self, req: RecvReq, num_blocks: int) -> None:
        self.xfer_stats.record(
            num_blocks, num_blocks * self._bytes_per_block, time.monotonic() - req.started
        )

    def _start_transfer(self, req: RecvReq, peer: str) -> None:
        notif = DONE + req.remote_request_id.encode()
        req.started = time.monotonic()
        if req.mode == "push":
            reg = {
                "rid": req.remote_request_id,
                "engine_id": self.engine_id,
                "host": self.host,
                "port": self.port,
                "first_block": req.first_block,
                "block_ids": req.local_block_ids,
            }
            self.backend.send_notif(peer, PUSH_REG + msgspec.msgpack.encode(reg))
            req.deadline = time.monotonic() + self.push_timeout_s
        elif self.codec is not None:
            req.deadline = time.monotonic() + self.transfer_timeout_s
            req.stage = "layout"
            req.future = self._layout_pool.submit(self._fetch_layout, req)
        else:
            req.handle = self.backend.read_blocks(
                peer, req.local_block_ids, req.remote_block_ids or [], notif
            )
            req.deadline = time.monotonic() + self.transfer_timeout_s
        self._recving[req.request_id] = req

    def _fail(self, req: RecvReq) -> None:
        """The request's KV will not arrive: its blocks are reported invalid (recompute or fail
        per policy) and the load is over."""
        self.xfer_stats.num_failed += 1
        self._load_errors.update(req.local_block_ids)
        self._done_recving.add(req.request_id)

    def _read_notifs(self) -> None:
        now = time.monotonic()
        by_remote = {r.remote_request_id: r for r in self._recving.values()}
        for msgs in self.backend.get_new_notifs().values():
            for msg in msgs:
                if msg.startswith(DONE):
                    self._release_send(msg[len(DONE) :].decode())
                elif msg.startswith(HEARTBEAT):
                    for rid in msg[len(HEARTBEAT) :].decode().split(","):
                        send = self._sending.get(rid)
                        if send is not None:
                            send.expiry = max(send.expiry, now + self.lease_s * 2 / 3)
                elif msg.startswith(PUSH_REG):
                    self._on_push_registration(msgspec.msgpack.decode(msg[len(PUSH_REG) :]))
                elif msg.startswith(PUSHED):
                    req = by_remote.get(msg[len(PUSHED) :].decode())
                    if req is not None and req.handle is None:
                        del self._recving[req.request_id]
                        self._done_recving.add(req.request_id)
                        self._record(req, len(req.local_block_ids))
                else:
                    logger.warning("unknown KV notification %r", msg[:40])
        self._progress_pushes()

    def _release_send(self, rid: str) -> None:
        with self._staged_lock:
            staged = self._staged.pop(rid, None)
        if isinstance(staged, list):
            free_frames(self.staging, staged)  # type: ignore[arg-type]
        if self._sending.pop(rid, None) is None:
            logger.info("KV of request %s was already released (its lease may have expired)", rid)
            return
        self._done_sending.add(rid)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        for rid, send in list(self._sending.items()):
            if now > send.expiry and send.push_handle is None:
                logger.warning(
                    "Releasing expired KV blocks of request %s (no consumer within the lease)", rid
                )
                self.xfer_stats.num_leases_expired += 1
                self._release_send(rid)

    def _heartbeat(self) -> None:
        """Consumer: keep the producers' leases alive for transfers still pending."""
        now = time.monotonic()
        if now - self._last_heartbeat < self.lease_s / 6:
            return
        self._last_heartbeat = now
        by_peer: dict[str, list[str]] = {}
        for req in self._recving.values():
            peer = self._peers[(req.engine_id, req.host, req.port)].name
            if peer is not None:
                by_peer.setdefault(peer, []).append(req.remote_request_id)
        for peer, rids in by_peer.items():
            self.backend.send_notif(peer, HEARTBEAT + ",".join(rids).encode())

    # ---- push (producer side) -------------------------------------------------------------------------

    def _on_push_registration(self, reg: dict[str, Any]) -> None:
        """A consumer registered its blocks for one of our requests: connect back to it."""
        self._push_regs[reg["rid"]] = (reg, time.monotonic())
        self._connect(
            RecvReq("", reg["rid"], reg["engine_id"], reg["host"], int(reg["port"]), 0, [], None)
        )

    def _progress_pushes(self) -> None:
        now = time.monotonic()
        for rid, (reg, arrived) in list(self._push_regs.items()):
            send = self._sending.get(rid)
            if send is None:  # not finished yet, or already released
                if now - arrived > self.push_timeout_s:
                    logger.warning(
                        "push registration for unknown or released request %s dropped", rid
                    )
                    del self._push_regs[rid]
                continue
            if send.push_handle is None:
                probe = RecvReq(
                    "", rid, reg["engine_id"], reg["host"], int(reg["port"]), 0, [], None
                )
                try:
                    peer = self._peer_name(probe)
                except HandshakeError:
                    del self._push_regs[rid]  # the consumer times out and recomputes
                    continue
                if peer is None:
                    continue
                first, dst = reg["first_block"], list(reg["block_ids"])
                src = send.block_ids[first : first + len(dst)]
                send.push_started = time.monotonic()
                send.push_handle = self.backend.write_blocks(
                    peer, src, dst[: len(src)], PUSHED + rid.encode()
                )
                continue
            state = self.backend.check_xfer_state(send.push_handle)
            if state == "PROC":
                continue
            self.backend.release_xfer(send.push_handle)
            del self._push_regs[rid]
            if state != "DONE":
                logger.error("push of request %s failed; the consumer recomputes", rid)
                self.xfer_stats.num_failed += 1
            else:
                n = len(send.block_ids)
                self.xfer_stats.record(
                    n, n * self._bytes_per_block, time.monotonic() - send.push_started
                )
            self._release_send(rid)

    # ---- compressed transfers (`kv_transfer.staging`) ----------------------------------------------

    def _encode(self, rid: str, block_ids: list[int]) -> None:
        """Producer, on a codec thread: encode the held blocks into the staging area."""
        try:
            frames = encode_blocks(self.staging, self.codec, self._regions, block_ids)  # type: ignore[arg-type]
            if frames is None:
                logger.warning("request %s: its frames do not fit the staging area; raw", rid)
        except Exception:  # noqa: BLE001 - serve the blocks raw rather than not at all
            logger.exception("request %s: encoding its KV failed; serving it raw", rid)
            frames = None
        with self._staged_lock:
            if self._staged.get(rid) == "pending":
                self._staged[rid] = frames if frames is not None else "raw"
                return
        if frames:  # released while encoding
            free_frames(self.staging, frames)  # type: ignore[arg-type]

    def _staged_query(self, rid: bytes) -> bytes:
        """The side channel's answer to ``staged:<rid>`` (on its thread)."""
        with self._staged_lock:
            entry = self._staged.get(rid.decode(errors="replace"))
        if entry is None:
            return layout_reply("unknown")
        return layout_reply(entry) if isinstance(entry, str) else layout_reply("ready", entry)

    def _fetch_layout(self, req: RecvReq) -> tuple[str, list[Frame]]:
        """Consumer, on a layout thread: ask the producer until its frames are ready."""
        while True:
            left = req.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the producer's frames were not ready in time")
            reply = side_channel_request(
                req.host,
                req.port,
                STAGED_PREFIX + req.remote_request_id.encode(),
                min(left, self.handshake_timeout_s),
                "the staged-KV query",
            )
            state, frames = parse_layout(reply)
            if state != "pending":
                return state, frames
            time.sleep(0.002)

    def _progress_staged(self, req: RecvReq, now: float) -> None:
        """Advance a compressed read one stage: layout -> alloc -> read -> decode -> done."""
        peer = self._peers[(req.engine_id, req.host, req.port)]
        if req.stage == "layout":
            if not req.future.done():  # type: ignore[union-attr]
                return
            try:
                state, frames = req.future.result()  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - no layout: recompute
                logger.error("request %s: no staged KV from its producer: %s", req.request_id, e)
                return self._end_staged(req, ok=False)
            want = len(req.local_block_ids)
            req.frames = frames[req.first_block : req.first_block + want]
            too_big = req.num_staging_slots > self.staging.num_slots  # type: ignore[union-attr]
            if state == "raw" or (state == "ready" and too_big):
                # Not staged by the producer, or more than our whole staging area: read the
                # blocks themselves (the producer holds them until we say done).
                req.stage, req.frames = "", []
                req.handle = self.backend.read_blocks(  # type: ignore[union-attr]
                    peer.name,
                    req.local_block_ids,
                    req.remote_block_ids or [],
                    DONE + req.remote_request_id.encode(),
                )
                return
            if state != "ready" or len(req.frames) != want:
                logger.error("request %s: producer's staged KV is %s", req.request_id, state)
                return self._end_staged(req, ok=False)
            req.stage = "alloc"
        if req.stage == "alloc":
            n = req.num_staging_slots
            req.staging_slot = self.staging.alloc(n)  # type: ignore[union-attr]
            if req.staging_slot is None:  # the staging area is full: wait for reads to finish
                if now > req.deadline:
                    self._end_staged(req, ok=False)
                return
            req.handle = self.staging_backend.read_blocks(  # type: ignore[union-attr]
                peer.staging_name,
                range(req.staging_slot, req.staging_slot + n),
                slots_of(req.frames),
            )
            req.stage = "read"
        if req.stage == "read":
            state = self.staging_backend.check_xfer_state(req.handle)  # type: ignore[union-attr, arg-type]
            if state == "PROC" and now <= req.deadline:
                return
            self.staging_backend.release_xfer(req.handle)  # type: ignore[union-attr, arg-type]
            req.handle = None
            if state != "DONE":
                return self._end_staged(req, ok=False)
            req.stage = "decode"
            req.future = self._codec_pool.submit(
                decode_blocks,
                self.staging,
                self.codec,
                self._regions,
                req.staging_slot,
                req.frames,
                req.local_block_ids,
            )
        if req.stage == "decode" and req.future.done():  # type: ignore[union-attr]
            err = req.future.exception()  # type: ignore[union-attr]
            if err is not None:
                logger.error("request %s: its KV frames do not decode: %s", req.request_id, err)
            self._end_staged(req, ok=err is None)

    def _end_staged(self, req: RecvReq, ok: bool) -> None:
        """Free the request's staging slots; tell the producer to free (it has nothing more to
        give); the blocks arrived, or are reported invalid and recomputed."""
        if req.staging_slot is not None:
            self.staging.free(req.staging_slot, req.num_staging_slots)  # type: ignore[union-attr]
            req.staging_slot = None
        del self._recving[req.request_id]
        req.stage = ""
        name = self._peers[(req.engine_id, req.host, req.port)].name
        if name is not None:
            self.backend.send_notif(name, DONE + req.remote_request_id.encode())  # type: ignore[union-attr]
        if not ok:
            return self._fail(req)
        self._done_recving.add(req.request_id)
        n = len(req.local_block_ids)
        self.xfer_stats.record(n, sum(f.nbytes for f in req.frames), time.monotonic() - req.started)

    # ---- introspection --------------------------------------------------------------------------------

    @property
    def num_transfers(self) -> int:
        return self.xfer_stats.num_transfers

    @property
    def num_failed_transfers(self) -> int:
        return self.xfer_stats.num_failed

    @property
    def num_expired_leases(self) -> int:
        return self.xfer_stats.num_leases_expired

    def get_kv_connector_stats(self) -> KVConnectorStats:
        st = self.xfer_stats.copy()
        st.transfers_in_flight = len(self._recving) + len(self._waiting_peer) + len(self._sending)
        st.peers = sorted(
            f"{e}@{h}:{p}" for (e, h, p), peer in self._peers.items() if peer.name is not None
        )
        return KVConnectorStats(transfer=st)

    def shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._layout_pool.shutdown(wait=False, cancel_futures=True)
        self._codec_pool.shutdown(wait=True, cancel_futures=True)  # decodes write our blocks
        for be in (self.backend, self.staging_backend):
            if be is not None:
                be.shutdown()
        self.backend = self.staging_backend = None


def buffer_regions(kv_buffer: Any, layout: str) -> list[MemoryRegion]:
    """The KV buffer as `MemoryRegion`s: one per index of the dimensions outside the block
    dimension ``B`` (``LBNHC``: one per layer), each holding ``num_blocks`` contiguous blocks."""
    layout = layout.upper()
    k = layout.index("B")
    sizes = list(kv_buffer.shape)
    num_regions = 1
    for d in sizes[:k]:
        num_regions *= d
    block_len = kv_buffer.element_size()
    for d in sizes[k + 1 :]:
        block_len *= d
    num_blocks = sizes[k]
    base = kv_buffer.data_ptr()
    return [
        MemoryRegion(base + r * num_blocks * block_len, num_blocks, block_len, block_len)
        for r in range(num_regions)
    ]


def regions_layout_name(layout: Any) -> str:
    return layout if isinstance(layout, str) else getattr(layout, "name", str(layout))
