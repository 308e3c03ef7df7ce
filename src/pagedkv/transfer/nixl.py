"""`NixlBackend`: `KVTransferBackend` over NIXL (UCX), the data plane vLLM's NixlConnector uses.

One ``nixl_agent`` per backend, named after the engine. Local KV regions are registered as DRAM
once and turned into one prepared per-block descriptor list (descriptor ``region * num_blocks +
block``); each peer's regions become a prepared remote list the same way, so a transfer is one
``make_prepped_xfer`` over index lists (NIXL merges contiguous descriptors itself).

Notifications use ``get_new_notifs`` only (never ``check_remote_xfer_done``, which consumes a
separate stash: mixing them loses notifs). A notif attached to a transfer is sent by NIXL after
the data landed (nixl#252); ``send_notif`` is unordered with transfers (nixl#246).

The progress thread sleeps ``progress_delay_us`` between polls: NIXL's Python wrapper hard-codes
0 (a busy loop), and two spinning agents made this 2-core host's matmuls 2.7x slower
(``benchmarks/results/nixl_progress_delay.json``).

Bounded: a transfer still ``PROC`` after ``timeout_s`` is reported ``"ERR"`` (UCX may never
fail a transfer to a peer that died mid-flight).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pagedkv.transfer.base import KVTransferBackend, MemoryRegion, XferState

logger = logging.getLogger(__name__)

_LOCAL = "NIXL_INIT_AGENT"
DEFAULT_PROGRESS_DELAY_US = 100
_agent_lock = threading.Lock()


def make_agent(name: str, config: Any, progress_delay_us: int) -> Any:
    """A ``nixl_agent`` whose progress thread sleeps ``progress_delay_us`` between polls.

    ``nixl_agent.__init__`` sets ``nixlAgentConfig.pthrDelay = 0`` and offers no parameter, so
    its module's ``nixlBind`` is swapped, for the constructor only and under a lock, for one
    whose ``nixlAgent`` applies the delay first. A wrapper without that attribute gets the
    library's default (busy) thread, with a warning."""
    from nixl_cu12 import _api, nixl_agent

    real = getattr(_api, "nixlBind", None)
    if real is None or not hasattr(real, "nixlAgent"):
        logger.warning("nixl_cu12 changed: the progress thread delay cannot be set (busy loop)")
        return nixl_agent(name, config)

    class _Bind:
        def __getattr__(self, key: str) -> Any:
            return getattr(real, key)

        def nixlAgent(self, agent_name: str, cfg: Any) -> Any:  # noqa: N802 - NIXL's name
            cfg.pthrDelay = progress_delay_us
            return real.nixlAgent(agent_name, cfg)

    with _agent_lock:
        _api.nixlBind = _Bind()
        try:
            return nixl_agent(name, config)
        finally:
            _api.nixlBind = real


def regions_to_wire(regions: Sequence[MemoryRegion]) -> list[list[int]]:
    """``[[base_addr, num_blocks, block_len, block_stride], ...]`` for the metadata blob."""
    return [[r.base_addr, r.num_blocks, r.block_len, r.block_stride] for r in regions]


def regions_from_wire(wire: Sequence[Sequence[int]]) -> list[MemoryRegion]:
    return [MemoryRegion(int(a), int(n), int(bl), int(bs)) for a, n, bl, bs in wire]


def check_regions_pair(
    local: Sequence[MemoryRegion], remote: Sequence[MemoryRegion], peer: str
) -> None:
    """ValueError naming the mismatch unless the two region lists can exchange blocks."""
    if not local:
        raise ValueError("register_kv_memory must be called before add_remote_agent")
    if len(local) != len(remote):
        raise ValueError(
            f"peer {peer!r} registered {len(remote)} KV regions, we have "
            f"{len(local)}: region counts must be equal"
        )
    for i, (lo, re) in enumerate(zip(local, remote)):
        if lo.block_len != re.block_len:
            raise ValueError(
                f"peer {peer!r} region {i} has block_len {re.block_len}, ours is "
                f"{lo.block_len}: block_len must be equal"
            )


def block_indices(regions: Sequence[MemoryRegion], block_ids: Sequence[int]) -> list[int] | None:
    """Descriptor indices ``region * num_blocks + block`` for every region, region-major;
    ``None`` if a block id is out of range in some region."""
    out: list[int] = []
    for r_idx, region in enumerate(regions):
        if any(b < 0 or b >= region.num_blocks for b in block_ids):
            return None
        offset = sum(r.num_blocks for r in regions[:r_idx])
        out.extend(offset + b for b in block_ids)
    return out


def block_descs(regions: Sequence[MemoryRegion]) -> list[tuple[int, int, int]]:
    """One ``(addr, len, dev 0)`` descriptor per block of every region, in index order."""
    return [(r.block_addr(b), r.block_len, 0) for r in regions for b in range(r.num_blocks)]


def region_span(region: MemoryRegion) -> int:
    """Bytes from the region's base to the end of its last block."""
    return (
        (region.num_blocks - 1) * region.block_stride + region.block_len if region.num_blocks else 0
    )


def registration_spans(regions: Sequence[MemoryRegion]) -> list[tuple[int, int]]:
    """``(addr, len)`` covering every region, overlapping or touching spans merged: regions of a
    layer-strided layout interleave, and memory is registered once per byte."""
    spans = sorted((r.base_addr, r.base_addr + region_span(r)) for r in regions if r.num_blocks)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


@dataclass(slots=True)
class _Peer:
    regions: list[MemoryRegion]
    dlist: Any  # nixl_prepped_dlist_handle of the peer's blocks


@dataclass(slots=True)
class _Xfer:
    peer: str
    deadline: float
    nixl_handle: Any = None  # None: nothing to move (notif-only), already DONE
    state: XferState = "PROC"


@dataclass(slots=True)
class _State:
    regions: list[MemoryRegion] = field(default_factory=list)
    reg_descs: Any = None
    local_dlist: Any = None
    peers: dict[str, _Peer] = field(default_factory=dict)
    xfers: dict[int, _Xfer] = field(default_factory=dict)
    closed: bool = False


class NixlBackend(KVTransferBackend):
    """NIXL agent ``name`` with the given NIXL ``backends`` (default UCX)."""

    kind = "nixl"

    def __init__(
        self,
        name: str,
        *,
        timeout_s: float = 10.0,
        backends: Sequence[str] = ("UCX",),
        num_threads: int = 0,
        progress_thread: bool = True,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    ) -> None:
        """``progress_thread``: NIXL's own progress thread (default on). Without it a peer
        that is not being polled (an idle engine, a blocked agent) stalls the transfers that
        target it until they time out. ``progress_delay_us``: its sleep between polls (NIXL's
        wrapper uses 0, a busy loop that takes a core from the engine on a CPU host)."""
        super().__init__(name)
        # NIXL's logger writes INFO lines to stdout (it would corrupt JSON output): WARN unless
        # the user chose a level.
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        from nixl_cu12 import nixl_agent_config  # lazy: optional dependency

        self.timeout_s = timeout_s
        config = nixl_agent_config(
            enable_prog_thread=progress_thread, backends=list(backends), num_threads=num_threads
        )
        self._agent = make_agent(name, config, int(progress_delay_us))
        self._s = _State()
        self._ids = itertools.count(1)

    # -- registration and peers ------------------------------------------------------------

    def register_kv_memory(self, regions: Sequence[MemoryRegion]) -> None:
        s = self._s
        if s.regions:
            raise RuntimeError("register_kv_memory called twice")
        if not regions:
            raise ValueError("no KV regions to register")
        s.reg_descs = self._agent.register_memory(
            [(addr, n, 0, "") for addr, n in registration_spans(regions)], "DRAM"
        )
        s.regions = list(regions)
        s.local_dlist = self._agent.prep_xfer_dlist(_LOCAL, block_descs(regions), "DRAM")

    def get_agent_metadata(self) -> bytes:
        if not self._s.regions:
            raise RuntimeError("register_kv_memory must be called before get_agent_metadata")
        return msgspec.msgpack.encode(
            {
                "name": self.name,
                "agent_metadata": self._agent.get_agent_metadata(),
                "regions": regions_to_wire(self._s.regions),
            }
        )

    def add_remote_agent(self, metadata: bytes) -> str:
        md = msgspec.msgpack.decode(metadata)
        regions = regions_from_wire(md["regions"])
        check_regions_pair(self._s.regions, regions, md.get("name", "?"))  # before touching NIXL
        raw = self._agent.add_remote_agent(md["agent_metadata"])
        peer = raw.decode() if isinstance(raw, bytes) else str(raw)  # NIXL 1.5.1 returns bytes
        if peer in self._s.peers:  # re-handshake (the peer re-registered): drop the old list
            self._agent.release_dlist_handle(self._s.peers.pop(peer).dlist)
        dlist = self._agent.prep_xfer_dlist(peer, block_descs(regions), "DRAM")
        self._s.peers[peer] = _Peer(regions, dlist)
        return peer

    def remove_remote_agent(self, peer: str) -> None:
        p = self._s.peers.pop(peer, None)
        if p is None:
            return
        for _handle, x in list(self._s.xfers.items()):
            if x.peer == peer and x.state == "PROC":
                x.state = "ERR"
                self._release_nixl(x)
        self._agent.release_dlist_handle(p.dlist)
        self._agent.remove_remote_agent(peer)

    # -- transfers ---------------------------------------------------------------------------

    def read_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes = b"",
    ) -> int:
        return self._start("READ", peer, local_block_ids, remote_block_ids, notif)

    def write_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes = b"",
    ) -> int:
        return self._start("WRITE", peer, local_block_ids, remote_block_ids, notif)

    def _start(
        self, op: str, peer: str, local_ids: Sequence[int], remote_ids: Sequence[int], notif: bytes
    ) -> int:
        """Post one prepped transfer; out-of-range ids or a NIXL refusal give an ERR handle."""
        p = self._peer(peer)
        if len(local_ids) != len(remote_ids):
            raise ValueError(f"{len(local_ids)} local vs {len(remote_ids)} remote block ids")
        handle = next(self._ids)
        x = _Xfer(peer, time.monotonic() + self.timeout_s)
        self._s.xfers[handle] = x
        if not local_ids:  # nothing to move: NIXL refuses an empty request, the notif still goes
            x.state = self._notify_only(peer, notif)
            return handle
        l_idx = block_indices(self._s.regions, local_ids)
        r_idx = block_indices(p.regions, remote_ids)
        if l_idx is None or r_idx is None:
            logger.warning("KV transfer to %s: block id out of range", peer)
            x.state = "ERR"
            return handle
        try:
            x.nixl_handle = self._agent.make_prepped_xfer(
                op, self._s.local_dlist, l_idx, p.dlist, r_idx, notif
            )
            x.state = self._map(self._agent.transfer(x.nixl_handle))
        except Exception as e:  # a NIXL error (peer gone, bad params) fails this transfer only
            logger.warning("NIXL %s to %s failed to post: %s", op, peer, e)
            x.state = "ERR"
        return handle

    def _notify_only(self, peer: str, notif: bytes) -> XferState:
        if not notif:
            return "DONE"
        try:
            self._agent.send_notif(peer, notif)
            return "DONE"
        except Exception as e:
            logger.warning("NIXL notif to %s failed: %s", peer, e)
            return "ERR"

    def check_xfer_state(self, handle: int) -> XferState:
        x = self._s.xfers[handle]
        if x.state != "PROC":
            return x.state
        try:
            x.state = self._map(self._agent.check_xfer_state(x.nixl_handle))
        except Exception as e:
            logger.warning("NIXL transfer to %s failed: %s", x.peer, e)
            x.state = "ERR"
        if x.state == "PROC" and time.monotonic() > x.deadline:
            logger.warning("NIXL transfer to %s timed out after %.1f s", x.peer, self.timeout_s)
            x.state = "ERR"
        return x.state

    def release_xfer(self, handle: int) -> None:
        x = self._s.xfers.pop(handle, None)
        if x is not None:
            self._release_nixl(x)

    def _release_nixl(self, x: _Xfer) -> None:
        """Release the NIXL request; if NIXL cannot cancel it, keep it alive (its __del__ retries)."""
        if x.nixl_handle is None:
            return
        try:
            self._agent.release_xfer_handle(x.nixl_handle)
            x.nixl_handle = None
        except Exception as e:
            logger.warning("NIXL could not release a transfer to %s: %s", x.peer, e)

    @staticmethod
    def _map(state: str) -> XferState:
        return state if state in ("DONE", "PROC") else "ERR"  # type: ignore[return-value]

    # -- notifications ---------------------------------------------------------------------------

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._peer(peer)
        self._agent.send_notif(peer, msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {str(k): list(v) for k, v in self._agent.get_new_notifs().items() if v}

    def _peer(self, peer: str) -> _Peer:
        p = self._s.peers.get(peer)
        if p is None:
            raise ValueError(f"unknown peer {peer!r}: add_remote_agent first")
        return p

    # -- teardown ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        s = self._s
        if s.closed:
            return
        s.closed = True
        for handle in list(s.xfers):
            self.release_xfer(handle)
        for peer in list(s.peers):
            try:
                self.remove_remote_agent(peer)
            except Exception as e:  # keep tearing down the rest
                logger.warning("NIXL remove_remote_agent(%s): %s", peer, e)
        if s.local_dlist is not None:
            self._agent.release_dlist_handle(s.local_dlist)
            s.local_dlist = None
        if s.reg_descs is not None:
            self._agent.deregister_memory(s.reg_descs)
            s.reg_descs = None
