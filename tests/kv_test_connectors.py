"""KV connectors for the tests of the connector seam (`tests/test_kv_connector.py`).

Importable as ``kv_test_connectors`` (``tests/`` is on ``sys.path``), so an engine finds them with
``kv_transfer_config={"kv_connector": "<class name>", "kv_connector_module_path":
"kv_test_connectors", ...}``.

* `ScriptedConnector`: scheduler side only; answers what the test configured and records
  every call (the scheduler-level tests simulate the worker with `KVConnectorOutput`s).
* `RecordingConnector`: matches nothing; records the order of the worker-side hooks.
* `InMemoryKVConnector`: a real "remote store" in host memory, keyed by block hash: saves the
  KV of finished prompts' full blocks, loads it asynchronously into freshly allocated blocks.
* `NotAConnector`: a class that is no `KVConnectorBase` (the factory must refuse it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.core.request import KVCacheRequest
from pagedkv.kv_transfer.base import BlockIds, KVConnectorBase, KVConnectorMetadata

Answer = tuple[int | None, bool]


class ScriptedConnector(KVConnectorBase):
    """Scheduler-side test double. ``answers[rid]``: what `get_num_new_matched_tokens` returns
    for ``rid`` (default ``(0, False)``), unless ``answer_fn(request, num_computed_tokens)`` is
    set; ``finish_answers[rid]``: what `request_finished` returns (default ``(False, None)``).
    Every call is recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answers: dict[str, Answer] = {}
        self.answer_fn: Callable[[KVCacheRequest, int], Answer] | None = None
        self.finish_answers: dict[str, tuple[bool, dict[str, Any] | None]] = {}
        self.matched_calls: list[tuple[str, int]] = []  # (rid, num_computed_tokens)
        # (rid, block ids, num_external_tokens, request.num_computed_tokens at call time)
        self.alloc_calls: list[tuple[str, BlockIds, int, int]] = []
        self.finished_calls: list[str] = []
        self.preempt_calls: list[str] = []
        self.outputs_seen: int = 0

    def get_num_new_matched_tokens(
        self, request: KVCacheRequest, num_computed_tokens: int
    ) -> Answer:
        self.matched_calls.append((request.request_id, num_computed_tokens))
        if self.answer_fn is not None:
            return self.answer_fn(request, num_computed_tokens)
        return self.answers.get(request.request_id, (0, False))

    def update_state_after_alloc(
        self, request: KVCacheRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        self.alloc_calls.append(
            (
                request.request_id,
                tuple(list(g) for g in block_ids),
                num_external_tokens,
                request.num_computed_tokens,
            )
        )

    def update_connector_output(self, connector_output: Any) -> None:
        self.outputs_seen += 1

    def request_finished(
        self, request: KVCacheRequest, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished_calls.append(request.request_id)
        return self.finish_answers.get(request.request_id, (False, None))

    def on_preempt(self, request: KVCacheRequest, block_ids: BlockIds) -> None:
        self.preempt_calls.append(request.request_id)


class RecordingConnector(KVConnectorBase):
    """Matches nothing; ``events`` lists the worker-side hooks in call order (``(name, arg)``),
    ``registered`` the layer names `register_kv_caches` got."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, Any]] = []
        self.registered: list[str] = []
        self.finished_calls: list[str] = []

    def get_num_new_matched_tokens(
        self, request: KVCacheRequest, num_computed_tokens: int
    ) -> Answer:
        return 0, False

    def update_state_after_alloc(
        self, request: KVCacheRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        self.events.append(("update_state_after_alloc", num_external_tokens))

    def request_finished(
        self, request: KVCacheRequest, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished_calls.append(request.request_id)
        return False, None

    def register_kv_caches(self, kv_caches: dict[str, Any], kv_buffer: Any = None) -> None:
        super().register_kv_caches(kv_caches, kv_buffer)
        self.registered = list(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        self.events.append(("bind", None))

    def start_load_kv(self) -> None:
        self._get_connector_metadata()  # bound before the first worker hook
        self.events.append(("start_load_kv", None))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.events.append(("wait_for_layer_load", layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        self.events.append(("save_kv_layer", layer_name))

    def wait_for_save(self) -> None:
        self.events.append(("wait_for_save", None))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.events.append(("get_finished", frozenset(finished_req_ids)))
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.events.append(("get_block_ids_with_load_errors", None))
        return set()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.events.append(("clear", None))


@dataclass(slots=True)
class InMemoryMetadata(KVConnectorMetadata):
    """One step's work: ``loads[rid]`` = ``[(block id, block hash)]`` to fill from the store;
    ``saves`` = ``[(block id, block hash)]`` whose KV the step's forward pass completes."""

    loads: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)
    saves: list[tuple[int, Any]] = field(default_factory=list)


class InMemoryKVConnector(KVConnectorBase):
    """A remote KV store in host memory: ``store[block hash][layer name] = (K, V)`` of one block.

    Scheduler side: a waiting request matches the stored blocks that continue its local hit
    (block aligned, always short of the whole prompt), loaded asynchronously; once a request's
    prompt is computed, its full prompt blocks are scheduled for saving. Worker side: saves
    copy per layer in `save_kv_layer` and are published in `wait_for_save`; loads are copied in
    `start_load_kv` and reported in `get_finished`.

    ``kv_connector_extra_config["corrupt_loads"]``: the last block of every load gets noise
    instead of the stored KV and is reported in `get_block_ids_with_load_errors` (a transfer
    that failed part way; the first block of a multi-block load stays valid)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.block_size = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.corrupt_loads = bool(self.config.get_from_extra_config("corrupt_loads", False))
        self.store: dict[Any, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.num_loaded_tokens = 0
        self.num_saved_blocks = 0
        self.num_failed_blocks = 0
        # scheduler side
        self._pending_loads: dict[str, list[tuple[int, Any]]] = {}
        self._saved_rids: set[str] = set()
        # worker side
        self._staged: dict[Any, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: KVCacheRequest, num_computed_tokens: int
    ) -> Answer:
        bs = self.block_size
        first = num_computed_tokens // bs
        limit = (request.num_tokens - 1) // bs  # never the whole prompt: the last token is computed
        n = 0
        while (
            first + n < min(limit, len(request.block_hashes))
            and request.block_hashes[first + n] in self.store
        ):
            n += 1
        return n * bs, n > 0

    def update_state_after_alloc(
        self, request: KVCacheRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        bs = self.block_size
        first = request.num_computed_tokens // bs
        count = num_external_tokens // bs
        self._pending_loads[request.request_id] = [
            (block_ids[0][i], request.block_hashes[i]) for i in range(first, first + count)
        ]

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = InMemoryMetadata(loads=self._pending_loads)
        self._pending_loads = {}
        bs = self.block_size
        for s in scheduler_output.scheduled:
            req = s.request
            if req.request_id in self._saved_rids or s.start + s.num_tokens < req.num_prompt_tokens:
                continue
            self._saved_rids.add(req.request_id)  # its prompt's KV is complete after this step
            meta.saves.extend(
                (s.block_ids[0][i], req.block_hashes[i])
                for i in range(req.num_prompt_tokens // bs)
                if req.block_hashes[i] not in self.store
            )
        return meta

    def request_finished(
        self, request: KVCacheRequest, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        self._saved_rids.discard(request.request_id)
        return False, None

    # ---- worker side ------------------------------------------------------------------------

    def start_load_kv(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, InMemoryMetadata)
        for rid, blocks in meta.loads.items():
            for i, (block_id, block_hash) in enumerate(blocks):
                corrupt = self.corrupt_loads and i == len(blocks) - 1
                for name, (k, v) in self.kv_caches.items():
                    if corrupt:
                        k[block_id].normal_()
                        v[block_id].normal_()
                    else:
                        sk, sv = self.store[block_hash][name]
                        k[block_id].copy_(sk)
                        v[block_id].copy_(sv)
                if corrupt:
                    self._load_errors.add(block_id)
                    self.num_failed_blocks += 1
            self.num_loaded_tokens += len(blocks) * self.block_size
            self._recving.add(rid)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, InMemoryMetadata)
        k, v = kv_layer
        for block_id, block_hash in meta.saves:
            self._staged.setdefault(block_hash, {})[layer_name] = (
                k[block_id].clone(),
                v[block_id].clone(),
            )

    def wait_for_save(self) -> None:
        for block_hash, layers in self._staged.items():
            if len(layers) == len(self.kv_caches):  # published only once every layer is saved
                self.store.setdefault(block_hash, layers)
                self.num_saved_blocks += 1
        self._staged = {}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving, self._recving = self._recving, set()
        return None, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


class NotAConnector:
    """Not a `KVConnectorBase`: the factory must refuse it."""
