"""Attention metadata: everything a layer needs to find its K/V in the paged cache.

Built once per step by the engine's ModelRunner and shared (read-only) by every layer.
The flat batch holds ``T`` query tokens from ``S`` sequences, laid out sequence by sequence;
each sequence contributes a prefill chunk (many tokens, possibly after cached context) or a
single decode token. Nothing here knows about requests: only tensors and their host copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class StepRows:
    """How a step's sequences split into decode rows (one query token) and prefill chunks,
    with the decode rows' tensors; derived from the metadata once and shared by every layer."""

    decode: list[int]  # sequence indices with query_len == 1
    prefill: list[int]  # sequence indices with query_len > 1
    tokens: torch.Tensor  # [R] int64: flat-batch index of each decode row's query token
    block_table: torch.Tensor  # [R, max_blocks] int32: the decode rows' block tables
    seq_lens: torch.Tensor  # [R] int32
    all_decode: bool  # every token of the batch is a decode row (tokens == arange(T))


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention metadata (vLLM's names).

    Invariants:
      * ``query_start_loc[0] == 0`` and ``query_start_loc[-1] == T``; sequence ``i`` owns
        query tokens ``[query_start_loc[i], query_start_loc[i+1])``.
      * ``seq_lens[i]`` is the total KV length of sequence ``i`` after this step
        (cached context + new tokens); its query tokens sit at positions
        ``seq_lens[i] - query_len_i .. seq_lens[i] - 1`` (causal).
      * ``block_table[i, j]`` is the physical block holding tokens
        ``[j*block_size, (j+1)*block_size)`` of sequence ``i``; unused entries are 0 (the null
        block) and are never read for positions < ``seq_lens[i]``.
      * ``slot_mapping[t] = block_id * block_size + pos % block_size`` for query token ``t``;
        a negative slot means "do not write" (padding).
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [S+1] int32 (cu_seqlens_q)
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks_per_seq] int32
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies (lists) so CPU kernels can plan work without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    _rows: StepRows | None = field(default=None, repr=False, compare=False)
    # Decode context parallelism: sequence ``i``'s tokens before this step that this rank holds
    # (at its local positions ``[0, n)``; ``block_table``/``block_size`` are then the rank's
    # physical blocks). None without DCP.
    dcp_local_context_lens: list[int] | None = None
    # Token eviction (SnapKV): called by `paged_attention` once per layer, after the step's
    # K/V are written, as ``kv_observer(query, paged_kv, block_size, scale)``
    # (`ops.token_eviction.SnapKVObserver`). The native decode step does not run with one set.
    kv_observer: Any = None
    # A vmm cache (`ops.vmm`): the caches are request rows ``[R, T, H, D]``, ``block_table[i]``
    # is sequence ``i``'s one row and ``block_size`` is T. Attention reads ``[0, seq_len)`` of
    # the row in place (past it the row is unmapped: a gather of the whole "block" would fault).
    contiguous: bool = False
    # A KIVI cache (`ops.kivi`): each sequence's residual row and the first position its
    # request computed itself (`ops.kivi.KiviStep`); None otherwise.
    kivi: Any = None

    def rows(self) -> StepRows:
        """The step's :class:`StepRows`, computed on first use (layers share the metadata)."""
        if self._rows is None:
            qsl = self.query_start_loc_cpu
            decode = [i for i in range(self.num_seqs) if qsl[i + 1] - qsl[i] == 1]
            prefill = [i for i in range(self.num_seqs) if qsl[i + 1] - qsl[i] > 1]
            dev = self.seq_lens.device
            idx = torch.tensor(decode, dtype=torch.int64, device=dev)
            self._rows = StepRows(
                decode,
                prefill,
                torch.tensor([qsl[i] for i in decode], dtype=torch.int64, device=dev),
                self.block_table[idx].to(torch.int32).contiguous(),
                self.seq_lens[idx].to(torch.int32),
                all_decode=len(decode) == self.num_tokens,
            )
        return self._rows

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]
