"""`KVConnectorBase`: the one seam between the scheduler and whatever moves KV outside the
device cache (vLLM's ``KVConnectorBase_V1`` split: a scheduler side that only does
bookkeeping and never blocks on I/O, a worker side that moves bytes around the forward pass).

The scheduler imports only this module (no torch, no tier code); `OffloadingConnector` is the
one implementation today. Requests are `core.request.KVCacheRequest`s (the engine's `Request`
extends it), so this layer never imports upward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.core.request import KVCacheRequest


class KVConnectorBase(ABC):
    """Scheduler side: `on_schedule_start`, `get_num_new_matched_tokens`,
    `update_state_after_alloc`, `request_finished`, `on_preempt`, `take_events`.
    Worker side: `start_load_kv` (before the forward pass), `save_kv` (after it).

    Contract: a request's blocks are not reused until `request_finished` / `on_preempt`
    returned (the connector waits there for the stores that read them)."""

    # ---- scheduler side ---------------------------------------------------------------------------

    def on_schedule_start(self) -> None:
        """A scheduling step begins (connectors that time requests across steps use it)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, req: KVCacheRequest, num_computed_tokens: int) -> int | None:
        """Tokens after the local hit of ``num_computed_tokens`` that can be loaded from outside;
        None while the answer is pending (the request stays waiting and is asked again)."""

    @abstractmethod
    def update_state_after_alloc(self, req: KVCacheRequest, block_ids: Sequence[int],
                                 num_computed_tokens: int, num_external_tokens: int) -> None:
        """Blocks were allocated for ``req``: queue the load of its external tokens into them."""

    @abstractmethod
    def request_finished(self, req: KVCacheRequest, block_ids: Sequence[int]) -> None:
        """``req`` finished: store what is still owed; return once its blocks may be freed."""

    @abstractmethod
    def on_preempt(self, req: KVCacheRequest, block_ids: Sequence[int]) -> None:
        """``req`` is preempted: as `request_finished`, before its blocks go back to the pool."""

    def take_events(self) -> list[Any]:
        """KV events of the connector's own media since the last call."""
        return []

    # ---- worker side ------------------------------------------------------------------------------

    @abstractmethod
    def start_load_kv(self) -> None:
        """Before the forward pass: run the loads queued by `update_state_after_alloc`."""

    @abstractmethod
    def save_kv(self, scheduled: Iterable[tuple[KVCacheRequest, Sequence[int], int]]) -> None:
        """After the forward pass: offer ``(request, block ids, tokens computed)`` to the store."""

    def shutdown(self) -> None:
        """Stop background work and release resources."""
