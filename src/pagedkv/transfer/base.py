"""`KVTransferBackend`: moves KV blocks between the memories of two engines.

The transfer engine behind the PD and P2P connectors. Two implementations run the same tests:
`NixlBackend` (NIXL over UCX: cross-memory attach on one host, TCP or RDMA across hosts) and
`TcpBackend` (pure Python for machines where NIXL cannot import). Connectors see only this
interface.

Memory model. An agent registers its KV memory once as `MemoryRegion`s: ``num_blocks`` blocks
of ``block_len`` bytes, block ``b`` at ``base_addr + b * block_stride``. Two agents that
exchange blocks register the same number of regions with equal ``block_len`` (one region per
layer for the ``LBNHC`` layout, or one for all layers when a block is contiguous across
layers); block ``b`` of a transfer moves region by region. The connector checks this in its
handshake before it calls `add_remote_agent`.

Protocol. ``get_agent_metadata()`` returns opaque bytes (the peer's address and regions) that
the connector sends out of band (its ZMQ side channel); the peer passes them to
`add_remote_agent`, which returns the peer's name. `read_blocks` / `write_blocks` start an
asynchronous transfer between local and remote block ids and return a handle;
`check_xfer_state` is polled until it is not ``"PROC"``. ``notif`` is delivered to the remote
agent after the data landed (the completion signal the producer waits for), and read there by
`get_new_notifs`; an empty block list still delivers it. The initiator must keep polling
`check_xfer_state`: NIXL emits a transfer's notif from that completion path, so an unpolled
WRITE never notifies. `send_notif` sends a control message alone (unordered with transfers);
with NIXL it reaches only a peer this agent added (`add_remote_agent`), so a reply channel needs
the handshake in both directions.

Errors. A transfer that cannot complete (dead peer, bad block id) ends ``"ERR"``, never hangs:
every wait in a backend is bounded. Thread safety: one thread per agent (the engine's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

XferState = Literal["DONE", "PROC", "ERR"]


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    base_addr: int
    num_blocks: int
    block_len: int  # bytes of one block in this region
    block_stride: int  # bytes from one block to the next (>= block_len)

    def block_addr(self, block_id: int) -> int:
        return self.base_addr + block_id * self.block_stride


class KVTransferBackend(ABC):
    """See the module docstring. ``name`` is the agent's unique name (an engine id)."""

    kind: str = ""  # "nixl" | "tcp": which transfer engine, logged at start

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def register_kv_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Register the local KV memory (once, before metadata is exported)."""

    @abstractmethod
    def get_agent_metadata(self) -> bytes:
        """What a peer needs to reach this agent and address its registered regions."""

    @abstractmethod
    def add_remote_agent(self, metadata: bytes) -> str:
        """Connect to the peer described by ``metadata``; returns its name. ValueError if its
        regions cannot pair with ours (count or ``block_len`` differ)."""

    @abstractmethod
    def remove_remote_agent(self, peer: str) -> None:
        """Forget a peer (its transfers in flight end ``"ERR"``)."""

    @abstractmethod
    def read_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes = b"",
    ) -> int:
        """Start copying the peer's ``remote_block_ids`` into our ``local_block_ids`` (same
        length, pairwise, every region); ``notif`` reaches the peer when done. Returns a handle."""

    @abstractmethod
    def write_blocks(
        self,
        peer: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes = b"",
    ) -> int:
        """Start copying our ``local_block_ids`` into the peer's ``remote_block_ids``."""

    @abstractmethod
    def check_xfer_state(self, handle: int) -> XferState:
        """``"DONE"``, ``"PROC"`` (in flight) or ``"ERR"``."""

    @abstractmethod
    def release_xfer(self, handle: int) -> None:
        """Free a finished (or failed) transfer's resources."""

    @abstractmethod
    def send_notif(self, peer: str, msg: bytes) -> None:
        """A control message to the peer (not ordered with transfers)."""

    @abstractmethod
    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending peer name."""

    @abstractmethod
    def shutdown(self) -> None:
        """Deregister memory, drop peers, stop threads. Idempotent."""
