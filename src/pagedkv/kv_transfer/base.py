"""`KVConnectorBase`: the one seam between the engine and whatever moves KV outside the device
cache (offload tiers, a prefill instance, a peer). vLLM's ``KVConnectorBase_V1`` split and
method names:

* **scheduler side** — bookkeeping only, never blocks on a transfer, never touches tensors:
  `get_num_new_matched_tokens`, `update_state_after_alloc`, `build_connector_meta`,
  `update_connector_output`, `request_finished`, `take_events`;
* **worker side** — moves bytes around the forward pass, driven by the `ModelRunner`:
  `register_kv_caches` (once), then per step `bind_connector_metadata` → `start_load_kv` →
  (per attention layer: `wait_for_layer_load` before it reads the cache, `save_kv_layer` after
  it wrote it) → `wait_for_save` → `get_finished` / `get_block_ids_with_load_errors` →
  `clear_connector_metadata`.

pagedkv runs the scheduler and the worker in one process, so one instance serves both sides;
``role`` names the side a multi-process deployment would build it for. The two sides share
nothing but the per-step `KVConnectorMetadata` (scheduler → worker) and `KVConnectorOutput`
(worker → scheduler), so a connector written against this class can be split later.

The scheduler's contract with a connector (`engine/scheduler.py`):

* a request whose external tokens load asynchronously (``load_async``) waits in
  ``WAITING_FOR_REMOTE_KVS`` with its blocks allocated until the worker reports it in
  ``finished_recving``; blocks reported in ``invalid_block_ids`` are recomputed or fail the
  request, per ``kv_load_failure_policy``;
* `request_finished` is called exactly once per request, before its blocks are freed; if it
  returns ``delay_free=True`` the blocks stay allocated until the worker reports the request in
  ``finished_sending``. Its ``kv_transfer_params`` reach the client in the request's output.

Torch-free (tensors are passed as ``Any``); requests are `core.request.KVCacheRequest`s, so
this module never imports upward.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.core.request import KVCacheRequest

if TYPE_CHECKING:
    from pagedkv.core.specs import KVCacheConfig
    from pagedkv.kv_transfer.config import KVTransferConfig
    from pagedkv.kv_transfer.stats import KVConnectorStats

BlockIds = tuple[list[int], ...]  # a request's block ids, one list per KV cache group


class KVConnectorRole(enum.IntEnum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (connectors subclass it)."""


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker side reports after one step (vLLM's ``KVConnectorOutput``).

    ``finished_sending``: requests whose KV was handed off (their delayed blocks may be freed);
    ``finished_recving``: requests whose asynchronous load ended — successfully or not; a failed
    one also has its blocks in ``invalid_block_ids``, the device blocks whose KV is not valid."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


class KVConnectorBase(ABC):
    """Base class of every KV connector (see the module docstring for the contract)."""

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        model_identity: str = "",
        hash_seed: str = "",
    ) -> None:
        """``model_identity`` names the weights (`models.loader.model_identity`): KV made by
        other weights must never be loaded, so connectors fold it into their fingerprints.
        ``hash_seed`` names how this engine hashes blocks (algorithm and ``NONE_HASH`` seed):
        peers that exchange blocks by hash must agree on it."""
        self.config = config
        self.model_identity = model_identity
        self.hash_seed = hash_seed
        self.role = role
        self.kv_cache_config = kv_cache_config
        self._metadata: KVConnectorMetadata | None = None
        self.kv_caches: dict[str, Any] = {}

    @classmethod
    def check_kv_cache_groups(cls, kv_cache_groups: list[Any]) -> None:
        """ValueError if this connector cannot serve a model with these KV cache groups. The
        engine asks before it sizes the cache, so the error names the real limit."""

    # ---- scheduler side ---------------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: KVCacheRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """``(tokens, load_async)``: how many tokens after the local hit of
        ``num_computed_tokens`` (block aligned) can be loaded from outside, and whether they
        arrive asynchronously (the request then waits in ``WAITING_FOR_REMOTE_KVS``).
        ``tokens`` None: not known yet — the request stays waiting and is asked again next
        step. ``load_async`` is False when ``tokens`` is 0. No side effects: a request may be
        asked and then not admitted (no room)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: KVCacheRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        """Blocks were allocated for ``request`` (``block_ids``: all of its blocks, per group;
        ``request.num_computed_tokens`` is the local hit): queue the load of its
        ``num_external_tokens`` external tokens into them. Called with 0 too."""

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Once per step, after scheduling: the work for the worker side this step (and reset
        the per-step state). Must not change ``scheduler_output``."""
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The worker side's report of a step, before the scheduler acts on it."""

    @abstractmethod
    def request_finished(
        self, request: KVCacheRequest, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished (or was aborted): called once, before its blocks are freed.
        Returns ``(delay_free, kv_transfer_params)``: with ``delay_free`` the blocks stay
        allocated until the request appears in ``finished_sending``; the params (or None) are
        returned to the client with the request's final output."""

    def on_preempt(self, request: KVCacheRequest, block_ids: BlockIds) -> None:
        """``request`` is preempted; its blocks go back to the pool when this returns
        (pagedkv's hook: the offloading connector saves a victim's KV here in swap mode)."""

    def on_schedule_start(self) -> None:
        """A scheduling step begins (connectors that time requests across steps use it)."""

    def take_events(self) -> list[Any]:
        """KV events of the connector's own media since the last call."""
        return []

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """A snapshot of the connector's counters, or None if it keeps none."""
        return None

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping although no request is scheduled (transfers
        in flight whose completion frees blocks or readies a request)."""
        return False

    # ---- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any], kv_buffer: Any = None) -> None:
        """Once, after the runner allocated the KV cache: ``layer name → (key_cache,
        value_cache)`` and the one contiguous tensor all of them are views of (transports
        register that region once)."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """After the step, whether the forward pass succeeded or not."""
        self._metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._metadata is not None, "no connector metadata bound (outside a step?)"
        return self._metadata

    def start_load_kv(self) -> None:
        """Before the forward pass: start (synchronous connectors: finish) this step's loads."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before attention layer ``layer_name`` reads the cache: its KV has arrived."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        """After attention layer ``layer_name`` wrote this step's KV into ``kv_layer``."""

    def wait_for_save(self) -> None:
        """After the forward pass (every step, even an empty one): this step's saves are
        submitted; their source blocks stay valid until they are reported."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)`` request ids since the last call;
        ``finished_req_ids``: requests the scheduler finished since the previous step."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the last call (synchronous loads: in the step
        that loaded them)."""
        return set()

    def shutdown(self) -> None:
        """Stop background work and release resources."""
