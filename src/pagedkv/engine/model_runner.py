"""`ModelRunner`: owns the KV cache tensors, and turns a `SchedulerOutput` into the tensors of
one forward pass and the logits to sample.

`initialize_kv_cache(kv_cache_config)` places every layer in its KV cache group, allocates the
one contiguous KV buffer with a (K, V) view per layer, and registers them with the KV
connector (`register_kv_caches`). Around each forward pass it drives the connector's worker
side: bind the step's metadata → `start_load_kv` → forward (the attention layers call
`wait_for_layer_load` / `save_kv_layer` through the forward context) → `wait_for_save` →
`get_finished` + `get_block_ids_with_load_errors` → clear. A step with nothing to compute still
runs the connector's side (loads may finish, sends may be reported).

Per step it builds, for the flat batch of ``T`` tokens from ``S`` requests: ``input_ids``,
``positions``, ``query_start_loc``, ``seq_lens``, ``block_table`` and ``slot_mapping``
(vLLM's names), runs the model once, and returns the logits of the last scheduled token of
every request whose scheduled tokens reach the end of its known tokens (decodes, and prefills
finishing this step). Before the pass it performs pending block copies (copy-on-write of a
forked request's partial block).

Prompt logprobs (``SamplingParams.prompt_logprobs``): for such a request (its first sample;
forked samples share its prompt) the runner also computes the logits of every prompt
position of every chunk, so that row ``p`` scores prompt token ``p + 1``; other requests pay
nothing. It remembers per request how many positions it has scored, so a recompute after
preemption scores nothing twice; it forgets a request once reported finished.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pagedkv.core.parallel import dcp_local_count, dcp_owner
from pagedkv.core.specs import (
    KIVI_SINK_ENTRIES,
    KVCacheConfig,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    iter_layer_specs,
)
from pagedkv.engine.kv_cache_binding import bind_kv_cache, bind_vmm_kv_cache
from pagedkv.engine.model_input import (
    KVCompaction,
    ModelInput,
    PromptLogprobsTask,
    ScheduledTokens,
)
from pagedkv.engine.multimodal import EncoderCache
from pagedkv.engine.sampler import LogprobsTensors, compute_prompt_logprobs
from pagedkv.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from pagedkv.engine.vmm import VMMRows
from pagedkv.kv_transfer.base import KVConnectorBase, KVConnectorOutput
from pagedkv.models.layers import RotaryEmbedding
from pagedkv.ops.cache import compute_slot_mapping
from pagedkv.ops.forward_context import set_forward_context
from pagedkv.ops.kivi import KiviResidual, KiviSinkStore, KiviStep, allocate_residuals
from pagedkv.ops.kv_cache import allocate_kv_cache, copy_blocks
from pagedkv.ops.kv_quant import KVQuant, KVQuantFormat
from pagedkv.ops.metadata import AttentionMetadata
from pagedkv.ops.token_eviction import (
    SnapKVObserver,
    SnapKVTarget,
    compact,
    rerotate_keys,
)
from pagedkv.ops.vmm import VirtualKVCache

# Prompt-logprob rows scored per model-head call: bounds the [rows, vocab] float32 temporaries.
PROMPT_LOGPROBS_ROWS_PER_PASS = 512

# request id -> (first prompt position scored this step, its logprobs): row ``i`` scores prompt
# token ``first + i + 1``.
PromptLogprobsOutput = dict[str, tuple[int, LogprobsTensors]]


class ModelRunner:
    """Runs the model over the paged KV cache.

    ``layer_groups[i]`` is the KV cache group of layer ``i`` (all 0 for a single-group model):
    every group has its own block tables and slot mappings, hence its own
    ``AttentionMetadata``, and each layer is given its group's. ``kv_caches`` holds one (K, V)
    view pair per layer; layers of different groups may alias the same memory (their block
    ids never overlap, since they come from one pool).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: Any,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        connector: KVConnectorBase | None = None,
        dcp: tuple[int, int, int] | None = None,
    ) -> None:
        self.model = model
        # Decode context parallelism: (dcp size, interleave, this rank's dcp rank), or None.
        self.dcp = dcp
        self.model_config = model_config
        self.dtype = dtype
        self.device = torch.device(device)
        self.connector = connector
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_buffer: torch.Tensor | None = None
        self.block_size = 0
        self.group_block_sizes: list[int] = []
        self.layer_groups: list[int] = []
        self.distinct_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_quants: dict[str, KVQuant] = {}  # layer name → its quantized/rotated cache format
        # vmm mode (`engine.vmm`): the virtual cache, each request's row, and the physical
        # views the connector registers (kv_caches are then the rows the model reads).
        self.vmm: VirtualKVCache | None = None
        self.vmm_rows: VMMRows | None = None
        # KIVI caches (`ops.kivi`): each running request's residual row, and the first
        # position it computed itself (what its row holds from).
        self.kivi_rows: VMMRows | None = None
        self.kivi_starts: dict[str, int] = {}
        self.kivi_held: set[str] = set()  # requests whose row holds restored sinks
        self.kivi_sinks: KiviSinkStore | None = None
        self.kivi_residuals: list[KiviResidual] = []  # distinct, allocated once
        self.kivi_saves: list[tuple[bytes, int]] = []  # (key, row): after this step's forward
        self.connector_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Vision-language models: encoder outputs by image hash (the engine sets the budget).
        self.encoder_cache = EncoderCache(budget=0)
        # request id -> prompt positions whose logits rows were scored (prompt_logprobs).
        self.num_prompt_logprobs_done: dict[str, int] = {}
        # request id -> the SnapKV selection of its compression (per attention layer,
        # [Hkv, budget] cache indices): kept for inspection and tests.
        self.last_kv_selection: dict[str, list[torch.Tensor]] = {}

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache ``kv_cache_config`` plans, bind every layer to its views
        (`bind_kv_cache`) and hand them to the connector. Raises ValueError if a layer with
        attention belongs to no group."""
        mc = self.model_config
        groups = kv_cache_config.kv_cache_groups
        if kv_cache_config.vmm is not None:
            b = bind_vmm_kv_cache(kv_cache_config, mc, self.dtype)
            self.vmm, self.vmm_rows = b.vmm, VMMRows(kv_cache_config.vmm.max_rows)
        else:
            b = bind_kv_cache(kv_cache_config, mc, self.dtype, self.device)
        self.kv_buffer, self.kv_caches, self.layer_groups = b.buffer, b.kv_caches, b.layer_groups
        self.connector_kv_caches = b.physical if b.physical is not None else b.kv_caches
        self.distinct_kv_caches = b.distinct
        self.group_block_sizes = [g.kv_cache_spec.block_size for g in groups]
        # The attention groups' block size (the pool's tokens per block where they agree).
        self.block_size = next(
            (
                g.kv_cache_spec.block_size
                for g in groups
                if not isinstance(g.kv_cache_spec, MambaSpec)
            ),
            self.group_block_sizes[0],
        )
        self.kv_quants = self._layer_kv_quants(groups)
        if kv_cache_config.kivi_rows:
            specs = dict(iter_layer_specs(groups))
            allocate_residuals(self.kv_quants, specs, kv_cache_config.kivi_rows, self.device)
            self.kivi_rows = VMMRows(kv_cache_config.kivi_rows)
            self.kivi_sinks = KiviSinkStore(KIVI_SINK_ENTRIES)
            self.kivi_residuals = KiviSinkStore.residuals(self.kv_quants)
        self.register_connector()

    def register_connector(self) -> None:
        """Hand the allocated KV cache to ``self.connector`` (if any)."""
        mc = self.model_config
        if self.connector is not None:
            owned = (i for i in range(mc.num_layers) if mc.owns_kv_cache(i))
            self.connector.register_kv_caches(
                {mc.layer_name(i): self.connector_kv_caches[i] for i in owned}, self.kv_buffer
            )

    def _layer_kv_quants(self, groups: list[Any]) -> dict[str, KVQuant]:
        """The :class:`KVQuant` each attention layer of a quantized or rotated cache was built
        with (``layer.kv_quant``: see :func:`layer_kv_quants`), by layer name. Raises ValueError
        when a layer's format is not its cache spec's (the model was built for another cache)."""
        specs = dict(iter_layer_specs(groups))
        quants: dict[str, KVQuant] = {}
        for module in self.model.modules():
            name = getattr(module, "layer_name", None)
            if name is None or not hasattr(module, "kv_quant") or name not in specs:
                continue
            want = KVQuantFormat.from_spec(specs[name]) if _wants_kv_quant(specs[name]) else None
            have = module.kv_quant.fmt if module.kv_quant is not None else None
            if have != want:
                raise ValueError(
                    f"{name}: built for KV format {have}, but its cache spec stores {want} "
                    "(build the model with get_model(..., kv_quants=...) from the same specs)"
                )
            if module.kv_quant is not None:
                quants[name] = module.kv_quant
        return quants

    def set_kv_scales(self, scales: dict[str, tuple[float, float]]) -> None:
        """Per-tensor fp8 scales by attention layer name (layers not named keep theirs)."""
        for name, (k, v) in scales.items():
            q = self.kv_quants.get(name)
            if q is not None:
                q.k_scale, q.v_scale = float(k), float(v)

    @torch.inference_mode()
    def observe_kv_amax(self, prompts: list[list[int]]) -> dict[str, tuple[float, float]]:
        """Run ``prompts`` through the model over a temporary float32 cache (no quantization,
        the real rotation) and return each layer's ``(max |K|, max |V|)`` as written. The one
        place a layer's ``kv_quant`` changes after it is built: swapped for an observing probe
        for the pass, and restored (the very objects) after it."""
        amax: dict[str, list[float]] = {}
        saved = dict(self.kv_quants)
        mc = self.model_config
        try:
            for name, q in saved.items():
                fmt = dataclasses.replace(q.fmt, mode=KVQuantMode.NONE)
                probe = KVQuant(fmt, rotation=q.rotation)
                probe.observe = functools.partial(_record_amax, amax.setdefault(name, [0.0, 0.0]))
                self._layer(name).kv_quant = probe
            for ids in prompts:
                n = len(ids)
                caches = [
                    allocate_kv_cache(
                        "LBNHC",
                        1,
                        2,
                        n,
                        max(mc.layer_kv_heads(i), 1),
                        mc.layer_head_dim(i),
                        torch.float32,
                        self.device,
                    )[1][0]
                    for i in range(mc.num_layers)
                ]
                dev = self.device
                md = AttentionMetadata(
                    slot_mapping=torch.arange(n, 2 * n, device=dev),
                    query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
                    seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
                    block_table=torch.tensor([[1]], dtype=torch.int32, device=dev),
                    block_size=n,
                    max_query_len=n,
                    max_seq_len=n,
                    query_start_loc_cpu=[0, n],
                    seq_lens_cpu=[n],
                )
                self.model(torch.tensor(ids, device=dev), torch.arange(n, device=dev), caches, md)
        finally:
            for name, q in saved.items():
                self._layer(name).kv_quant = q
        return {name: (a[0], a[1]) for name, a in amax.items()}

    def _layer(self, name: str) -> Any:
        return next(
            m
            for m in self.model.modules()
            if getattr(m, "layer_name", None) == name and hasattr(m, "kv_quant")
        )

    def build_model_input(self, so: SchedulerOutput) -> ModelInput:
        """The step as every rank runs it (`ModelInput`): forgets the finished requests' prompt
        logprob progress and decides which prompt rows are scored this step (driver only)."""
        for rid in so.finished_req_ids:
            self.num_prompt_logprobs_done.pop(rid, None)
        gone = [*so.finished_req_ids, *(r.request_id for r in so.preempted)]
        if self.vmm_rows is not None:  # their blocks return to the pool: unmap their rows
            for rid in gone:
                self._vmm_release(rid)
        for rid in gone:  # their images' encoder outputs may go when nobody else needs them
            self.encoder_cache.release(rid)
        if self.kivi_rows is not None:  # a resumed request starts a fresh residual
            for rid in gone:
                self.kivi_rows.release(rid)
                self.kivi_starts.pop(rid, None)
                self.kivi_held.discard(rid)
        scheduled = []
        for s in so.scheduled:
            req = s.request
            end = s.start + s.num_tokens
            task = None
            span = self._prompt_logprobs_span(s)
            if span is not None:
                first, last = span
                task = PromptLogprobsTask(
                    first,
                    last,
                    req.prompt_token_ids[first + 1 : last + 1],
                    req.sampling_params.prompt_logprobs,
                )
                self.num_prompt_logprobs_done[req.request_id] = last
            st = ScheduledTokens(
                req.request_id,
                req.all_token_ids[s.start : end],
                s.start,
                s.block_ids,
                s.samples,
                task,
            )
            if self.kivi_rows is not None and req.block_hashes:
                st.sink_key = req.block_hashes[0]
            if req.mm_features:
                st.mm = [
                    (f.identifier, f.offset, f.length, px)
                    for f, px in zip(req.mm_features, req.mm_inputs)
                    if f.offset < end and f.offset + f.length > s.start
                ]
            if req.kv_eviction is not None:
                st.kv_offset, st.cache_positions = s.kv_offset, s.cache_positions
                st.rerotate, st.rerotate_from = s.rerotate, s.rerotate_from
                st.layer_shift = s.layer_shift
                if s.compaction is not None:
                    ev = req.kv_eviction
                    assert s.layer_kept is not None
                    st.compaction = KVCompaction(
                        s.compaction,
                        end - s.kv_offset,
                        s.layer_kept,
                        ev.sink_tokens,
                        ev.recent_tokens,
                        ev.pool_kernel,
                    )
            scheduled.append(st)
        return ModelInput(scheduled, list(so.blocks_to_copy))

    def prepare_inputs(
        self, mi: ModelInput
    ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], list[int]]:
        """``(input_ids, positions, attn_metadata per group, logits_indices)`` for the step."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        # Token eviction: a token's cache index is its position minus its request's evicted
        # tokens (slots and seq_lens are in cache indices; RoPE positions are too only with
        # cache positions).
        evicting = any(s.kv_offset for s in mi.scheduled)
        cache_index: list[int] = []
        for s in mi.scheduled:
            end = s.start + s.num_tokens
            off = s.kv_offset
            token_ids.extend(s.token_ids)
            rope_off = off if s.cache_positions else 0
            positions.extend(range(s.start - rope_off, end - rope_off))
            if evicting:
                cache_index.extend(range(s.start - off, end - off))
            query_start_loc.append(query_start_loc[-1] + s.num_tokens)
            seq_lens.append(end - off)
            if s.samples:
                logits_indices.append(query_start_loc[-1] - 1)
        dev = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        kv_pos = torch.tensor(cache_index, dtype=torch.long, device=dev) if evicting else pos
        # A decode-only step (one token a request) computes its few slots in Python: cheaper
        # than the tensor ops below, which pay off for prefill chunks (measured at batch 1).
        decode_only = len(token_ids) == len(mi.scheduled)
        if not decode_only and self.dcp is None:
            counts = torch.tensor([s.num_tokens for s in mi.scheduled], device=dev)
            req_indices = torch.repeat_interleave(
                torch.arange(len(mi.scheduled), device=dev), counts
            )
        qsl = torch.tensor(query_start_loc, dtype=torch.int32, device=dev)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        max_query_len = max(s.num_tokens for s in mi.scheduled)
        # What every group's metadata shares (each adds its slots, table and block size).
        meta = functools.partial(
            AttentionMetadata,
            query_start_loc=qsl,
            seq_lens=lens,
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        if self.vmm is not None:
            rows = self._vmm_map(mi)
            per_token = (
                rows
                if decode_only
                else [r for s, r in zip(mi.scheduled, rows) for _ in range(s.num_tokens)]
            )
            span = self.vmm.virtual.shape[3]  # tokens of a row: the "block" attention reads
            slots = torch.tensor(per_token, dtype=torch.int64, device=dev) * span + kv_pos
            md = meta(
                slot_mapping=slots,
                block_table=torch.tensor(rows, dtype=torch.int32, device=dev).view(-1, 1),
                block_size=span,
                contiguous=True,
            )
            return input_ids, pos, [md], logits_indices
        mds = []
        for g in range(len(self.group_block_sizes)):
            max_blocks = max(len(s.block_ids[g]) for s in mi.scheduled)
            block_table = torch.tensor(
                [s.block_ids[g] + [0] * (max_blocks - len(s.block_ids[g])) for s in mi.scheduled],
                dtype=torch.int32,
                device=dev,
            )
            bs = self.group_block_sizes[g]
            local_ctx = None
            if self.dcp is not None:
                slots, local_ctx = self._dcp_slots(mi, bs)
            elif decode_only:
                slots = torch.tensor(
                    [
                        s.block_ids[g][(s.start - s.kv_offset) // bs] * bs
                        + (s.start - s.kv_offset) % bs
                        for s in mi.scheduled
                    ],
                    dtype=torch.int64,
                    device=dev,
                )
            else:
                slots = compute_slot_mapping(block_table, req_indices, kv_pos, bs)
            mds.append(
                meta(
                    slot_mapping=slots,
                    block_table=block_table,
                    block_size=bs,
                    dcp_local_context_lens=local_ctx,
                )
            )
        if self.kivi_rows is not None:
            step = self._kivi_step(mi)
            for md in mds:
                md.kivi = step
        return input_ids, pos, mds, logits_indices

    def _kivi_step(self, mi: ModelInput) -> KiviStep:
        """Each scheduled request's residual row; a request new to its row holds its residual
        from this step's first position (earlier ones came from the prefix cache or a load),
        and the sinks too where the sink store has its first block's (restored now). A
        request whose sinks this step computes has them saved after the forward pass."""
        assert self.kivi_rows is not None and self.kivi_sinks is not None
        in_step = {s.request_id for s in mi.scheduled}
        residuals = self.kivi_residuals
        sink = residuals[0].sink if residuals else 0
        rows, starts, held = [], [], []
        for s in mi.scheduled:
            rid = s.request_id
            row, evicted = self.kivi_rows.acquire(rid, in_step)
            if evicted is not None:
                self.kivi_starts.pop(evicted, None)
                self.kivi_held.discard(evicted)
            if rid not in self.kivi_starts:  # new to its row
                self.kivi_starts[rid] = s.start
                if s.start >= sink and self.kivi_sinks.restore(s.sink_key, residuals, row):
                    self.kivi_held.add(rid)
            start = self.kivi_starts[rid]
            if start == 0 and s.sink_key is not None and s.start < sink <= s.start + s.num_tokens:
                self.kivi_saves.append((s.sink_key, row))
            rows.append(row)
            starts.append(start)
            held.append(rid in self.kivi_held)
        return KiviStep(rows, starts, held if any(held) else None)

    def _kivi_save_sinks(self) -> None:
        """Keep the sinks this step computed (`_kivi_step`), for later hits on their block."""
        if self.kivi_saves:
            assert self.kivi_sinks is not None
            for key, row in self.kivi_saves:
                self.kivi_sinks.save(key, self.kivi_residuals, row)
            self.kivi_saves.clear()

    def _vmm_map(self, mi: ModelInput) -> list[int]:
        """vmm mode: each scheduled request's row, with its block table's pages mapped in
        (pages before the step's first token read-only). A request that takes the row of one
        not in this step (preempted, not yet told) has that row unmapped first."""
        assert self.vmm is not None and self.vmm_rows is not None
        in_step = {s.request_id for s in mi.scheduled}
        bs = self.block_size
        rows = []
        for s in mi.scheduled:
            row, evicted = self.vmm_rows.acquire(s.request_id, in_step)
            if evicted is not None:
                self.vmm.release(row)
            self.vmm.map_blocks(row, list(s.block_ids[0]), s.start // bs)
            rows.append(row)
        return rows

    def _vmm_release(self, request_id: str) -> None:
        assert self.vmm is not None and self.vmm_rows is not None
        row = self.vmm_rows.release(request_id)
        if row is not None:
            self.vmm.release(row)

    def _dcp_slots(self, mi: ModelInput, bs: int) -> tuple[torch.Tensor, list[int]]:
        """Decode context parallelism: this rank's slot of each token (-1 where another DCP
        rank holds it) and each sequence's past tokens held here. ``bs`` is the physical block
        size; the scheduler's block ids name virtual blocks of ``bs × dcp`` tokens."""
        assert self.dcp is not None
        d, interleave, rank = self.dcp
        span = bs * d
        slots: list[int] = []
        local_ctx: list[int] = []
        for s in mi.scheduled:
            blocks = s.block_ids[0]
            for p in range(s.start, s.start + s.num_tokens):
                owner, local = dcp_owner(p % span, d, interleave)
                slots.append(blocks[p // span] * bs + local if owner == rank else -1)
            local_ctx.append(dcp_local_count(s.start, bs, d, interleave, rank))
        return torch.tensor(slots, dtype=torch.int64, device=self.device), local_ctx

    @torch.inference_mode()
    def execute_model(
        self,
        so: SchedulerOutput,
        mi: ModelInput | None = None,
        ranks_done: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, KVConnectorOutput | None, PromptLogprobsOutput]:
        """Run one forward pass (none for an empty step) with the connector's worker side
        around it. Returns float32 logits ``[num_sampling_requests, vocab]`` in the order of
        ``so.scheduled`` (requests that do not sample this step are skipped), the connector's
        report (None without a connector), and the prompt logprobs scored this step.

        A TP engine's driver passes the ``mi`` it sent the other ranks, and ``ranks_done``,
        which waits for their part of the connector's work before the step's report."""
        mi = self.build_model_input(so) if mi is None else mi
        c = self.connector
        if c is None:
            logits, prompt_lps = self.execute_model_input(mi)
            return logits, None, prompt_lps
        c.bind_connector_metadata(so.kv_connector_metadata)
        try:
            c.start_load_kv()
            logits, prompt_lps = torch.empty((0, 0), dtype=torch.float32), {}
            if not so.is_empty:
                with set_forward_context(c):
                    logits, prompt_lps = self.execute_model_input(mi)
            c.wait_for_save()
            if ranks_done is not None:
                ranks_done()
            sending, recving = c.get_finished(so.finished_req_ids)
            out = KVConnectorOutput(
                sending or set(), recving or set(), c.get_block_ids_with_load_errors()
            )
        finally:
            c.clear_connector_metadata()
        return logits, out, prompt_lps

    @torch.inference_mode()
    def execute_model_input(self, mi: ModelInput) -> tuple[torch.Tensor, PromptLogprobsOutput]:
        """The forward pass of ``mi`` on this rank (every rank of a TP engine runs the same):
        ``(logits [num sampling requests, vocab], prompt logprobs)``."""
        prompt_lps: PromptLogprobsOutput = {}
        if mi.is_empty:
            return torch.empty((0, 0), dtype=torch.float32), prompt_lps
        if mi.blocks_to_copy:
            copy_blocks(self.distinct_kv_caches, mi.blocks_to_copy)
        # Token eviction's work (re-rotation, SnapKV, PyramidKV shifts) only where a request
        # has dropped tokens or compresses this step: one pass over the batch otherwise.
        evicting = any(s.kv_offset or s.compaction is not None for s in mi.scheduled)
        if evicting:
            self._rerotate_keys(mi)
        input_ids, positions, mds, logits_indices = self.prepare_inputs(mi)
        observer = self._snapkv_observer(mi) if evicting else None
        for m in mds:
            m.kv_observer = observer
        md = mds[0] if len(mds) == 1 else [mds[g] for g in self.layer_groups]
        if evicting and any(s.layer_shift for s in mi.scheduled):
            md = self._shifted_layer_metadata(mi, mds[0])
        if any(s.mm for s in mi.scheduled):
            embeds = self._multimodal_embeds(mi, input_ids)
            hidden = self.model(input_ids, positions, self.kv_caches, md, inputs_embeds=embeds)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, md)
        if observer is not None:
            self._compact(mi, observer)
        self._kivi_save_sinks()
        self._score_prompts(mi, hidden, prompt_lps)
        if not logits_indices:
            return hidden.new_empty((0, 0), dtype=torch.float32), prompt_lps
        if (
            len(logits_indices) < hidden.shape[0]
        ):  # else every row samples (a decode step): no gather
            hidden = hidden[torch.tensor(logits_indices, device=hidden.device)]
        return self.model.compute_logits(hidden), prompt_lps

    def _multimodal_embeds(self, mi: ModelInput, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's token embeddings with each image's encoder output in its placeholder
        rows (only the rows this step computes: a chunk may hold part of a run)."""
        embeds = self.model.embed(input_ids)
        row = 0
        for s in mi.scheduled:
            end = s.start + s.num_tokens
            for key, offset, length, pixels in s.mm:
                enc = self.encoder_cache.get(
                    key, s.request_id, lambda px=pixels: self.model.encode_images(px[None])[0]
                )
                lo, hi = max(s.start, offset), min(end, offset + length)
                embeds[row + lo - s.start : row + hi - s.start] = enc[lo - offset : hi - offset].to(
                    embeds.dtype
                )
            row += s.num_tokens
        return embeds

    # ---- token eviction (`ops.token_eviction`) -----------------------------------------------

    def rotary_embedding(self) -> RotaryEmbedding | None:
        """The model's standard RoPE (None for a model without one): what re-rotates keys."""
        rope = getattr(getattr(self.model, "model", None), "rotary_emb", None)
        return rope if type(rope) is RotaryEmbedding else None

    def _owner_layers(self) -> list[int]:
        mc = self.model_config
        return [i for i in range(mc.num_layers) if mc.owns_kv_cache(i)]

    def _rerotate_keys(self, mi: ModelInput) -> None:
        """StreamingLLM with cache positions: the window's keys move back by the tokens
        released this step, so their RoPE angles follow their new cache indices."""
        todo = [s for s in mi.scheduled if s.rerotate]
        if not todo:
            return
        rope = self.rotary_embedding()
        assert rope is not None, "cache positions need a RoPE model (checked at admission)"
        for s in todo:
            cos, sin = rope.cos_sin(torch.tensor([s.rerotate], device=self.device))
            last = s.start - s.kv_offset
            for i in self._owner_layers():
                rerotate_keys(
                    self.kv_caches[i][0],
                    s.block_ids[0],
                    s.rerotate_from,
                    last,
                    cos,
                    -sin,
                    RotaryEmbedding.apply,
                )

    def _shifted_layer_metadata(
        self, mi: ModelInput, md: AttentionMetadata
    ) -> list[AttentionMetadata]:
        """PyramidKV: one metadata per layer, whose slots and ``seq_lens`` sit ``shift`` cache
        indices earlier for each request that has a shift in that layer (one group only)."""
        counts = [s.num_tokens for s in mi.scheduled]
        dev = self.device
        req_idx = torch.repeat_interleave(
            torch.arange(len(counts), device=dev), torch.tensor(counts, device=dev)
        )
        kv_pos = torch.cat(
            [
                torch.arange(s.start - s.kv_offset, s.start - s.kv_offset + s.num_tokens)
                for s in mi.scheduled
            ]
        ).to(dev)
        out: list[AttentionMetadata] = []
        owner = {layer: c for c, layer in enumerate(self._owner_layers())}
        cache: dict[tuple[int, ...], AttentionMetadata] = {}
        for layer in range(self.model_config.num_layers):
            c = owner.get(layer)
            shift = tuple(
                s.layer_shift[c] if s.layer_shift is not None and c is not None else 0
                for s in mi.scheduled
            )
            if not any(shift):
                out.append(md)
                continue
            if shift not in cache:
                per_tok = torch.tensor(shift, device=dev)[req_idx]
                lens = [n - d for n, d in zip(md.seq_lens_cpu, shift)]
                cache[shift] = dataclasses.replace(
                    md,
                    slot_mapping=compute_slot_mapping(
                        md.block_table, req_idx, kv_pos - per_tok, md.block_size
                    ),
                    seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                    seq_lens_cpu=lens,
                    max_seq_len=max(lens),
                    _rows=None,
                )
            out.append(cache[shift])
        return out

    def _snapkv_observer(self, mi: ModelInput) -> SnapKVObserver | None:
        targets = []
        q_end = 0
        for s in mi.scheduled:
            q_end += s.num_tokens
            if s.compaction is not None:
                targets.append(SnapKVTarget(q_end, s.num_tokens, s.block_ids[0], s.compaction))
        return SnapKVObserver(targets) if targets else None

    def _compact(self, mi: ModelInput, observer: SnapKVObserver) -> None:
        """Copy each compressing request's kept tokens into its new table, layer by layer."""
        owners = self._owner_layers()
        comps = [s for s in mi.scheduled if s.compaction is not None]
        for s, t in zip(comps, observer.targets, strict=True):
            if len(t.selected) != len(owners):
                raise RuntimeError(
                    f"snapkv: {type(self.model).__name__} scored {len(t.selected)} of "
                    f"{len(owners)} attention layers (a layer bypasses paged_attention)"
                )
            assert s.compaction is not None
            for i, idx in zip(owners, t.selected, strict=True):
                compact(self.kv_caches[i], s.block_ids[0], s.compaction.block_ids, idx)
        self.last_kv_selection = {
            s.request_id: t.selected for s, t in zip(comps, observer.targets, strict=True)
        }

    def _score_prompts(
        self, mi: ModelInput, hidden: torch.Tensor, out: PromptLogprobsOutput
    ) -> None:
        """Prompt logprobs of this step's prompt rows, for requests asking for them (into ``out``)."""
        offset = 0
        for s in mi.scheduled:
            task = s.prompt_logprobs
            if task is not None:
                first, last = task.first, task.last
                targets = torch.tensor(task.targets, dtype=torch.long, device=hidden.device)
                rows = hidden[offset + first - s.start : offset + last - s.start]
                k, n = task.k, PROMPT_LOGPROBS_ROWS_PER_PASS
                parts = [
                    compute_prompt_logprobs(
                        self.model.compute_logits(rows[i : i + n]), targets[i : i + n], k
                    )
                    for i in range(0, last - first, n)
                ]
                out[s.request_id] = (
                    first,
                    LogprobsTensors(
                        torch.cat([p.token_ids for p in parts]),
                        torch.cat([p.logprobs for p in parts]),
                        torch.cat([p.ranks for p in parts]),
                    ),
                )
            offset += s.num_tokens

    def _prompt_logprobs_span(self, s: ScheduledRequest) -> tuple[int, int] | None:
        """``(first, last)``: the prompt positions ``[first, last)`` whose rows score prompt
        tokens this step, or None. Row ``num_prompt - 1`` predicts the first output token (the
        sampler's row), not a prompt token; positions scored before a preemption are skipped."""
        req = s.request
        if req.sampling_params.prompt_logprobs is None or req.sample_index != 0:
            return None
        first = max(s.start, self.num_prompt_logprobs_done.get(req.request_id, 0))
        last = min(s.start + s.num_tokens, len(req.prompt_token_ids) - 1)
        return (first, last) if first < last else None


def _record_amax(acc: list[float], key: torch.Tensor, value: torch.Tensor) -> None:
    """Accumulate ``[max|K|, max|V|]`` over written rows."""
    acc[0] = max(acc[0], float(key.abs().amax()))
    acc[1] = max(acc[1], float(value.abs().amax()))


def _wants_kv_quant(spec: KVCacheSpec) -> bool:
    """Whether a layer of this cache spec needs a :class:`KVQuant` (a quantized or rotated
    attention cache; a Mamba state never does)."""
    mode = getattr(spec, "kv_quant_mode", KVQuantMode.NONE)
    return mode is not KVQuantMode.NONE or getattr(spec, "kv_rotation", None) is not None


def layer_kv_quants(
    model_config: Any, specs: Mapping[str, KVCacheSpec], device: torch.device | str = "cpu"
) -> dict[str, KVQuant]:
    """The :class:`KVQuant` of every attention layer whose cache ``specs`` (layer name → spec,
    ``ModelConfig.kv_cache_specs``) quantize or rotate, by layer name: what the model class
    is built with (``get_model(..., kv_quants=...)``), each layer receiving its own. A layer
    reading another layer's cache (KV sharing) gets that layer's object: it reads that format.
    The format does not depend on the block size, so specs of any block size give the same."""
    quants = {
        name: KVQuant.for_spec(spec, device)
        for name, spec in specs.items()  # type: ignore[arg-type]
        if _wants_kv_quant(spec)
    }
    for i in range(model_config.num_layers):
        target = model_config.kv_sharing_target(i)
        if target is not None and model_config.layer_name(target) in quants:
            quants[model_config.layer_name(i)] = quants[model_config.layer_name(target)]
    return quants
