"""Tensor- and decode-context-parallel geometry: which heads, rows and tokens each rank holds.

Pure Python (no torch): the planner (`pagedkv plan`), the engine and every worker derive a
rank's share from the same functions, so the capacity the plan prints is the one the workers
allocate.

Tensor parallelism (vLLM's ``--tensor-parallel-size N``) splits every attention layer by heads
and every MLP by intermediate rows; the embedding and LM head by vocabulary rows. Heads are
split along whole KV groups (a rank's query heads always read KV heads it holds, so each rank's
attention is an ordinary GQA over its own cache):

* ``N <= num_kv_heads``: the KV heads are cut into ``N`` near-equal runs and each rank takes the
  query heads of its run. vLLM requires ``num_kv_heads % N == 0``; here an uneven split is
  allowed (SmolLM2's 3 KV heads at TP=2: 2 + 1), at the price of uneven work.
* ``N > num_kv_heads``: each KV head is *replicated* on ``N / num_kv_heads`` consecutive ranks
  (vLLM's QKVParallelLinear rule, so ``N`` must be a multiple of ``num_kv_heads``) and its
  query heads are split among them.

Decode context parallelism (``--decode-context-parallel-size D``, D divides N) shards the
sequence dimension of the KV cache across the ``D`` consecutive ranks that would otherwise hold
copies of the same KV heads: the scheduler's blocks are *virtual* blocks of ``block_size × D``
tokens, and within one, token offset ``o`` lives on DCP rank ``(o // I) % D`` (``I`` =
``cp_kv_cache_interleave_size``) at local offset ``(o // (I·D))·I + o % I``. Each rank's
physical block holds ``block_size`` tokens, so a rank's KV memory holds D times the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

EXECUTOR_BACKENDS = ("uni", "mp", "ray")


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``n`` items are cut into ``parts`` contiguous
    near-equal runs (the first ``n % parts`` runs hold one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(slots=True, frozen=True)
class HeadShard:
    """The global query heads ``[q_start, q_end)`` and KV heads ``[kv_start, kv_end)`` a rank
    holds; query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_heads(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_end - self.kv_start


def shard_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> HeadShard:
    """Rank ``rank``'s heads at TP ``tp`` (module docstring). ValueError when the heads cannot
    be split so: more ranks than query heads, or ``tp > num_kv_heads`` not a multiple of it."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside tensor_parallel_size={tp}")
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        kv0, kv1 = split_range(num_kv_heads, tp, rank)
        return HeadShard(kv0 * group, kv1 * group, kv0, kv1)
    if tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} exceeds the model's {num_kv_heads} KV heads and is not a "
            "multiple of them: each KV head must be replicated on a whole number of ranks"
        )
    copies = tp // num_kv_heads
    if copies > group:
        raise ValueError(
            f"tensor_parallel_size={tp} exceeds the model's {num_heads} attention heads"
        )
    kv, j = divmod(rank, copies)
    q0, q1 = split_range(group, copies, j)
    return HeadShard(kv * group + q0, kv * group + q1, kv, kv + 1)


def kv_replicas(num_kv_heads: int, tp: int) -> int:
    """How many ranks hold a copy of each KV head (1: none replicated)."""
    return max(tp // num_kv_heads, 1) if tp > num_kv_heads else 1


def check_parallel_sizes(
    tp: int, dcp: int, num_heads: int, num_kv_heads: int, interleave: int = 1
) -> None:
    """ValueError naming the option when TP ``tp`` / DCP ``dcp`` cannot run this model."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if not isinstance(dcp, int) or dcp < 1:
        raise ValueError(f"decode_context_parallel_size must be a positive integer, got {dcp!r}")
    if not isinstance(interleave, int) or interleave < 1:
        raise ValueError(
            f"cp_kv_cache_interleave_size must be a positive integer, got {interleave!r}"
        )
    for rank in range(tp):
        shard_heads(num_heads, num_kv_heads, tp, rank)  # raises when the heads do not split
    if tp % dcp:
        raise ValueError(
            f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp}"
        )
    if dcp > 1 and kv_replicas(num_kv_heads, tp) % dcp:
        raise ValueError(
            f"decode_context_parallel_size={dcp} shards the KV cache across ranks holding copies "
            f"of the same KV heads, but at tensor_parallel_size={tp} the model's {num_kv_heads} "
            f"KV heads have {kv_replicas(num_kv_heads, tp)} cop(ies) each: DCP must divide "
            f"tensor_parallel_size / num_kv_heads"
        )


@dataclass(slots=True, frozen=True)
class RankLayout:
    """Everything rank ``rank`` of a TP×DCP engine holds: its heads, its rows of the MLP and of
    the vocabulary, and its place in its DCP group (ranks ``dcp_group_start ..
    dcp_group_start + dcp_size - 1`` hold the same KV heads and split their tokens)."""

    rank: int
    tp_size: int
    heads: HeadShard
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    dcp_size: int = 1
    dcp_interleave: int = 1
    # Query heads of each rank of this rank's DCP group, in rank order (DCP all-gathers them).
    dcp_head_counts: tuple[int, ...] = ()
    # Mamba-2 mixers (hybrid models): the rank's SSM heads (``q_*``) and B/C groups (``kv_*``),
    # split as query heads over KV heads are (a group replicated past ``n_groups`` ranks).
    mamba: HeadShard | None = None

    @property
    def dcp_rank(self) -> int:
        return self.rank % self.dcp_size

    @property
    def dcp_group_start(self) -> int:
        return self.rank - self.dcp_rank

    @property
    def namespace(self) -> str:
        """The rank's key namespace for tiers and transfers (MooncakeStore's form)."""
        return f"@tp_rank:{self.rank}@dcp{self.dcp_rank}"


def rank_layout(
    *,
    rank: int,
    tp: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
    dcp: int = 1,
    interleave: int = 1,
    mamba_heads: tuple[int, int] | None = None,
) -> RankLayout:
    """The :class:`RankLayout` of ``rank`` (sizes checked by :func:`check_parallel_sizes`);
    ``mamba_heads``: a hybrid model's Mamba ``(n_heads, n_groups)``."""
    check_parallel_sizes(tp, dcp, num_heads, num_kv_heads, interleave)
    mamba = None
    if mamba_heads is not None:
        try:
            mamba = shard_heads(mamba_heads[0], mamba_heads[1], tp, rank)
        except ValueError as e:
            raise ValueError(f"the Mamba mixers' heads do not split: {e}") from None
    first = rank - rank % dcp
    counts = tuple(
        shard_heads(num_heads, num_kv_heads, tp, r).num_heads for r in range(first, first + dcp)
    )
    return RankLayout(
        rank=rank,
        tp_size=tp,
        heads=shard_heads(num_heads, num_kv_heads, tp, rank),
        intermediate=split_range(intermediate_size, tp, rank),
        vocab=split_range(vocab_size, tp, rank),
        dcp_size=dcp,
        dcp_interleave=interleave,
        dcp_head_counts=counts,
        mamba=mamba,
    )


def kv_shard_id(layout: RankLayout) -> tuple[int, ...]:
    """What rank ``layout.rank``'s KV cache holds, as a comparable value: ranks with equal ids
    hold byte-identical caches (a KV head replicated past ``num_kv_heads`` ranks, no DCP), so
    a tier stores one copy of them (MooncakeStore's KV-head de-duplication). The DCP rank is
    part of the id (DCP ranks hold different tokens of the same heads), and so are a hybrid's
    Mamba heads (split over every rank, never replicated)."""
    m = layout.mamba
    mamba = () if m is None else (m.q_start, m.q_end, m.kv_start, m.kv_end)
    return (layout.heads.kv_start, layout.heads.kv_end, layout.dcp_rank, *mamba)


def kv_shard_writers(layouts: list[RankLayout]) -> list[int]:
    """For each rank (in order), the lowest rank whose KV cache is identical to it
    (:func:`kv_shard_id`): the one rank that writes that shard to a tier; the others only read.
    ``min(tp, num_kv_heads)`` distinct writers without DCP, every rank with it."""
    first: dict[tuple[int, ...], int] = {}
    return [first.setdefault(kv_shard_id(lay), lay.rank) for lay in layouts]


def max_rank_kv_heads(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """The most KV heads any rank holds: every rank has as many blocks as the largest needs."""
    return max(shard_heads(num_heads, num_kv_heads, tp, r).num_kv_heads for r in range(tp))


def dcp_owner(offset: int, dcp: int, interleave: int) -> tuple[int, int]:
    """``(dcp rank, local offset)`` of token offset ``offset`` inside a virtual block."""
    return (offset // interleave) % dcp, (
        offset // (interleave * dcp)
    ) * interleave + offset % interleave


def dcp_local_count(
    num_tokens: int, block_size: int, dcp: int, interleave: int, dcp_rank: int
) -> int:
    """How many of a sequence's first ``num_tokens`` tokens DCP rank ``dcp_rank`` holds (they
    sit at its local positions ``[0, count)``)."""
    span = block_size * dcp
    full, rem = divmod(num_tokens, span)
    cycles, part = divmod(rem, interleave * dcp)
    return (
        full * block_size
        + cycles * interleave
        + min(max(part - dcp_rank * interleave, 0), interleave)
    )
