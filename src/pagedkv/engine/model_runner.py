"""`ModelRunner`: a `SchedulerOutput` → the tensors of one forward pass → logits to sample.

Per step it builds, for the flat batch of ``T`` tokens from ``S`` requests: ``input_ids``,
``positions``, ``query_start_loc``, ``seq_lens``, ``block_table`` and ``slot_mapping``
(vLLM's names), runs the model once, and returns the logits of the last scheduled token of
every request whose scheduled tokens reach the end of its known tokens (decodes, and prefills
finishing this step). Before the pass it performs pending block copies (copy-on-write of a
forked request's partial block).
"""

from __future__ import annotations

import torch

from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.ops.cache import compute_slot_mapping
from pagedkv.ops.kv_cache import KVCacheViews, copy_blocks
from pagedkv.ops.metadata import AttentionMetadata


class ModelRunner:
    """Runs the model over the paged KV cache.

    ``layer_groups[i]`` is the KV cache group of layer ``i`` (all 0 for a single-group model):
    every group has its own block tables and slot mappings, hence its own
    ``AttentionMetadata``, and each layer is given its group's. ``kv_caches`` holds one (K, V)
    view pair per layer; layers of different groups may alias the same memory (their block
    ids never overlap, since they come from one pool).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: KVCacheViews, block_size: int,
                 device: torch.device | str = "cpu", layer_groups: list[int] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.layer_groups = layer_groups or [0] * len(kv_caches)
        # copy_blocks must copy each distinct tensor once (aliased layers would copy twice).
        self.distinct_kv_caches = list({kv[0].data_ptr(): kv for kv in kv_caches}.values())

    def prepare_inputs(self, so: SchedulerOutput
                       ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], list[int]]:
        """``(input_ids, positions, attn_metadata per group, logits_indices)`` for the step."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for s in so.scheduled:
            end = s.start + s.num_tokens
            token_ids.extend(s.request.all_token_ids[s.start:end])
            positions.extend(range(s.start, end))
            query_start_loc.append(query_start_loc[-1] + s.num_tokens)
            seq_lens.append(end)
            if s.samples:
                logits_indices.append(query_start_loc[-1] - 1)
        dev = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        counts = torch.tensor([s.num_tokens for s in so.scheduled], device=dev)
        req_indices = torch.repeat_interleave(torch.arange(len(so.scheduled), device=dev), counts)
        qsl = torch.tensor(query_start_loc, dtype=torch.int32, device=dev)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        max_query_len = max(s.num_tokens for s in so.scheduled)
        mds = []
        for g in range(max(self.layer_groups) + 1):
            max_blocks = max(len(s.block_ids[g]) for s in so.scheduled)
            block_table = torch.tensor([s.block_ids[g] + [0] * (max_blocks - len(s.block_ids[g]))
                                        for s in so.scheduled], dtype=torch.int32, device=dev)
            mds.append(AttentionMetadata(
                slot_mapping=compute_slot_mapping(block_table, req_indices, pos, self.block_size),
                query_start_loc=qsl, seq_lens=lens, block_table=block_table, block_size=self.block_size,
                max_query_len=max_query_len, max_seq_len=max(seq_lens),
                query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens))
        return input_ids, pos, mds, logits_indices

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> torch.Tensor:
        """Run one forward pass; returns float32 logits ``[num_sampling_requests, vocab]`` in
        the order of ``so.scheduled`` (requests that do not sample this step are skipped)."""
        if so.blocks_to_copy:
            copy_blocks(self.distinct_kv_caches, so.blocks_to_copy)
        input_ids, positions, mds, logits_indices = self.prepare_inputs(so)
        md = mds[0] if len(mds) == 1 else [mds[g] for g in self.layer_groups]
        hidden = self.model(input_ids, positions, self.kv_caches, md)
        if not logits_indices:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(logits_indices, device=hidden.device)])
