"""KV offloading of models with several KV cache groups (issue 15 item 6).

Core level (`offload.kv_groups`, no model): a tier hit is the largest lcm-aligned length every
group serves — full attention needs every block, a sliding window only the window's blocks
before the hit, chunked local only the hit's chunk, Mamba only the checkpoint ending there —
also with groups of different block sizes (the engine serves one block size today); stores
skip released positions and follow the saved offset; the fingerprint covers the group layout.

Engine level: tiny random-weight Gemma 2 (sliding + global) and Llama 4 (chunked local + NoPE
global) checkpoints written with ``save_pretrained``: a prompt evicted from the device cache
comes back from the CPU tier (loaded tokens > 0) and the greedy output is token-identical to
transformers'; with one group's blocks hidden from the tier the hit shrinks to what every
group serves; a disk tier survives a restart; a single-group model with the same weights
identity never reads the hybrid model's files. Tiny Bamba (Mamba-2 + attention, blocks of 48):
the Mamba checkpoint comes back from the tier with the attention blocks (retention None and
k), and retention 0 never loads.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from pagedkv.offload.base import (
    LookupResult,
    OffloadingEvent,
    get_offload_block_hash,
    get_offload_group_idx,
)
from pagedkv.offload.fingerprint import OffloadFingerprint
from pagedkv.offload.kv_groups import OffloadGroupLayout

BLOCK = 4
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# ---- core level: the rules, with a set of stored (group, block) positions -------------------------


def attn(cls: type, block_size: int, **kw: Any) -> Any:
    return cls(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32", **kw)


def layout(*specs: Any, retention: int | None = None) -> OffloadGroupLayout:
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    return OffloadGroupLayout.from_kv_cache_groups(groups, retention)


def hashes(num_tokens: int, hash_block_size: int) -> list[bytes]:
    return [i.to_bytes(8, "big") for i in range(num_tokens // hash_block_size)]


def stored_lookup(
    lay: OffloadGroupLayout,
    num_tokens: int,
    stored: set[tuple[int, int]],
    pending: frozenset[tuple[int, int]] = frozenset(),
):
    """A prefix lookup (`OffloadingManager.lookup_many` semantics) over stored (group, block)."""
    h = hashes(num_tokens, lay.hash_block_size)
    keys = {
        k: (g, b)
        for g in range(len(lay.groups))
        for b, k in enumerate(lay.keys(h, g, range(lay.num_full_blocks(h, g))))
    }
    asked: list[tuple[int, list[int]]] = []

    def lookup(gid: int, blocks: Sequence[int]) -> list[LookupResult]:
        asked.append((gid, list(blocks)))
        out: list[LookupResult] = []
        for key in lay.keys(h, gid, blocks):
            g, b = keys[key]
            assert g == gid
            r = (
                LookupResult.HIT
                if (g, b) in stored
                else LookupResult.HIT_PENDING
                if (g, b) in pending
                else LookupResult.MISS
            )
            out.append(out[-1] if out and out[-1] is not LookupResult.HIT else r)
        return out

    return lookup, asked


def everything(lay: OffloadGroupLayout, num_tokens: int) -> set[tuple[int, int]]:
    return {(g, b) for g, grp in enumerate(lay.groups) for b in range(num_tokens // grp.block_size)}


def test_keys_are_per_group_and_per_block_hash() -> None:
    lay = layout(attn(FullAttentionSpec, 4), attn(SlidingWindowSpec, 8, sliding_window=16))
    h = hashes(64, lay.hash_block_size)
    assert lay.hash_block_size == 4 and lay.alignment == 8
    k0, k1 = lay.keys(h, 0, [3]), lay.keys(h, 1, [1])
    # Block 1 of the 8-token group ends where block 3 of the 4-token group does: same hash,
    # another group index, so another key.
    assert get_offload_block_hash(k0[0]) == get_offload_block_hash(k1[0]) == h[3]
    assert (get_offload_group_idx(k0[0]), get_offload_group_idx(k1[0])) == (0, 1)


def test_hit_is_the_minimum_over_groups_aligned_to_their_lcm() -> None:
    """Full (block 4) + sliding window 16 (block 8): lcm 8."""
    lay = layout(attn(FullAttentionSpec, 4), attn(SlidingWindowSpec, 8, sliding_window=16))
    n = 100
    stored = everything(lay, n)
    lookup, _ = stored_lookup(lay, n, stored)
    assert lay.find_hit(0, n - 1, lookup) == (96, False)  # 99 tokens, aligned down to 8
    assert lay.find_hit(32, n - 1, lookup) == (64, False)  # past a local hit
    # The full group misses its block 13 (tokens 52..55): a hit may end at 52, but 52 is not
    # a multiple of the lcm, so 48.
    lookup, _ = stored_lookup(lay, n, stored - {(0, 13)})
    assert lay.find_hit(0, n - 1, lookup) == (48, False)
    # The sliding group misses its block 11 (tokens 88..95): a hit at 96 reads it (its next
    # token sees the 15 before it: blocks 10 and 11), one at 88 does not (blocks 9 and 10).
    lookup, _ = stored_lookup(lay, n, stored - {(1, 11)})
    assert lay.find_hit(0, n - 1, lookup) == (88, False)
    # ... but a sliding block far before the window is never needed.
    lookup, asked = stored_lookup(lay, n, stored - {(1, 2)})
    assert lay.find_hit(0, n - 1, lookup) == (96, False)
    assert asked == [(0, list(range(24))), (1, [10, 11])]
    # Both groups shrink it in turn (fixed point): full stops at 80, then the window of 80
    # (blocks 8, 9) misses block 8 → 64.
    lookup, _ = stored_lookup(lay, n, stored - {(0, 20), (1, 8)})
    assert lay.find_hit(0, n - 1, lookup) == (64, False)
    # A pending answer below the hit says "ask again"; nothing at all → no hit.
    lookup, _ = stored_lookup(lay, n, stored - {(1, 11)}, pending=frozenset({(1, 11)}))
    assert lay.find_hit(0, n - 1, lookup) == (88, True)
    lookup, _ = stored_lookup(lay, n, set())
    assert lay.find_hit(0, n - 1, lookup) == (0, False)


def test_chunked_local_needs_only_the_hit_chunk() -> None:
    lay = layout(
        attn(ChunkedLocalAttentionSpec, 4, attention_chunk_size=16), attn(FullAttentionSpec, 4)
    )
    n = 61
    stored = everything(lay, n)
    lookup, asked = stored_lookup(lay, n, stored - {(0, 5)})  # an earlier chunk: not needed
    assert lay.find_hit(0, n - 1, lookup) == (60, False)
    assert asked[0] == (0, [12, 13, 14])
    lookup, _ = stored_lookup(lay, n, stored - {(0, 13)})
    assert lay.find_hit(0, n - 1, lookup) == (52, False)
    lookup, _ = stored_lookup(lay, n, stored - {(0, 12)})  # a hit at the chunk edge needs none
    assert lay.find_hit(0, n - 1, lookup) == (48, False)


def test_mamba_needs_only_its_checkpoint_and_follows_retention() -> None:
    mamba = MambaSpec(block_size=8, shapes=((2, 3),), dtypes=("float32",), mamba_cache_mode="align")
    full = attn(FullAttentionSpec, 8)
    n = 50
    lay = layout(mamba, full)
    stored = {(1, b) for b in range(6)} | {(0, 3)}  # attention up to 48, one checkpoint at 32
    lookup, _ = stored_lookup(lay, n, stored)
    assert lay.find_hit(0, n - 1, lookup) == (32, False)
    assert lay.find_hit(0, n - 1, stored_lookup(lay, n, stored | {(0, 5)})[0]) == (48, False)
    # Retention 16: checkpoints (and so hits) only at multiples of 16; stores skip the others.
    lay16 = layout(mamba, full, retention=16)
    assert lay16.alignment == 16
    assert lay16.find_hit(0, n - 1, stored_lookup(lay16, n, stored | {(0, 4)})[0]) == (32, False)
    assert list(lay16.store_blocks(0, 0, 48)) == [1, 3, 5]
    assert list(lay16.store_blocks(1, 0, 48)) == list(range(6))
    # Retention 0 (end-of-step states): a load has no page to land in, so never a hit.
    lay0 = layout(mamba, full, retention=0)
    assert not lay0.can_load
    assert lay0.find_hit(0, n - 1, stored_lookup(lay0, n, everything(lay0, n))[0]) == (0, False)


def test_fingerprint_covers_the_group_layout() -> None:
    single = layout(attn(FullAttentionSpec, 4))
    hybrid = layout(attn(FullAttentionSpec, 4), attn(SlidingWindowSpec, 4, sliding_window=16))
    other_window = layout(attn(FullAttentionSpec, 4), attn(SlidingWindowSpec, 4, sliding_window=32))
    base = dict(
        model="m",
        dtype="float32",
        block_size=4,
        layout="BLNHC",
        num_layers=2,
        num_kv_heads=1,
        head_size=8,
    )
    fps = [
        OffloadFingerprint(**base, kv_cache_groups=lay.describe())
        for lay in (single, hybrid, other_window)
    ]
    assert len({fp.hexdigest for fp in fps}) == 3
    # One full-attention group: described by the other fields, digest as before groups counted.
    assert single.describe() == "" and fps[0].hexdigest == OffloadFingerprint(**base).hexdigest
    with pytest.raises(ValueError, match="cross_attention"):
        from pagedkv.core.specs import CrossAttentionSpec

        layout(attn(CrossAttentionSpec, 4, max_num_encoder_input_tokens=8))


def test_tier_events_carry_each_groups_block_size() -> None:
    lay = layout(attn(FullAttentionSpec, 4), attn(SlidingWindowSpec, 8, sliding_window=16))
    h = hashes(32, 4)
    ev = OffloadingEvent(tuple(lay.keys(h, 0, [0, 1]) + lay.keys(h, 1, [0])), "CPU", False)
    stored = ev.to_kv_events([g.block_size for g in lay.groups])
    assert [(e.group_idx, e.block_size, len(e.block_hashes)) for e in stored] == [
        (0, 4, 2),
        (1, 8, 1),
    ]


def test_connector_with_different_block_sizes_stores_new_ranges_and_loads_every_group() -> None:
    """The connector over full (blocks of 4) + sliding window 16 (blocks of 8), which the
    engine does not run yet: stores end on lcm (8) boundaries, each store offers only the range
    after the request's saved offset and skips released blocks; a later request loads the
    minimum over groups into each group's own blocks."""
    from types import SimpleNamespace

    from pagedkv.core.specs import KVCacheConfig
    from pagedkv.kv_transfer.base import KVConnectorRole
    from pagedkv.kv_transfer.config import offloading_transfer_config
    from pagedkv.kv_transfer.offloading_connector import OffloadingConnector
    from pagedkv.offload.cpu_manager import CPUOffloadingManager

    specs = [attn(FullAttentionSpec, 4), attn(SlidingWindowSpec, 8, sliding_window=16)]
    kvc = KVCacheConfig(
        num_blocks=64,
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
        bytes_per_block=1,
    )
    conn = OffloadingConnector(
        offloading_transfer_config("cpu:1MiB"), KVConnectorRole.SCHEDULER, kvc
    )
    conn.manager = manager = CPUOffloadingManager(64)
    offered: list[list[bytes]] = []
    real_prepare = manager.prepare_store
    manager.prepare_store = lambda keys: offered.append(list(keys)) or real_prepare(keys)
    lay = conn.layout
    h = hashes(52, 4)
    req = SimpleNamespace(
        request_id="a",
        block_hashes=h,
        num_tokens=52,
        kv_transfer_params=None,
        skip_reading_prefix_cache=False,
        num_computed_tokens=0,
    )
    full_ids, sliding_ids = list(range(1, 14)), list(range(20, 27))
    job = conn._prepare_store(req, (full_ids, sliding_ids), 20)  # 20 computed: stores end at 16
    assert offered[-1] == lay.keys(h, 0, range(4)) + lay.keys(h, 1, range(2))
    assert job.src.ids == (1, 2, 3, 4, 20, 21)
    sliding_ids[2] = 0  # the window moved on: block 2 of the sliding group was released
    job2 = conn._prepare_store(req, (full_ids, sliding_ids), 45)  # ... to 40: only what is new
    assert offered[-1] == lay.keys(h, 0, range(4, 10)) + lay.keys(h, 1, [3, 4])
    assert job2.src.ids == (5, 6, 7, 8, 9, 10, 23, 24)
    manager.complete_store(job.keys + job2.keys)
    # A new request with this prefix: full holds 40 tokens, sliding the window before 40.
    other = SimpleNamespace(**(vars(req) | {"request_id": "b"}))
    assert conn.get_num_new_matched_tokens(other, 0) == (40, False)
    new_full, new_sliding = list(range(30, 43)), [0, 0, 0, 50, 51, 52, 53]
    conn.update_state_after_alloc(other, (new_full, new_sliding), 40)
    (load,) = conn._pending_loads.values()
    assert load.keys == lay.keys(h, 0, range(10)) + lay.keys(h, 1, [3, 4])
    assert load.dst_block_ids == new_full[:10] + [50, 51]


# ---- engine level: tiny Gemma 2 and Llama 4 -------------------------------------------------------


def _gemma_config(**overrides: Any) -> Any:
    from test_gemma2 import tiny_config

    return tiny_config(**overrides)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from test_gemma2 import build

    hf = build(_gemma_config())
    out = tmp_path_factory.mktemp("hybrid") / "tiny"  # the leaf name is part of the model identity
    hf.save_pretrained(out)
    return hf, out


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from test_llama4 import build, tiny_config

    hf = build(tiny_config())
    out = tmp_path_factory.mktemp("tiny_llama4_offload")
    hf.save_pretrained(out)
    return hf, out


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    from test_gemma2 import hf_greedy as greedy

    return greedy(hf, prompt, n)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def run(llm: LLM, ids: list[int]) -> tuple[list[int], int]:
    (out,) = llm.generate({"prompt_token_ids": ids}, PARAMS, use_tqdm=False)
    engine = llm.llm_engine
    engine.check_invariants()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_config.num_blocks - 1
    return out.outputs[0].token_ids, out.num_cached_tokens


def group_of(llm: LLM, spec_type: type) -> list[int]:
    groups = llm.llm_engine.kv_cache_config.kv_cache_groups
    return [i for i, g in enumerate(groups) if type(g.kv_cache_spec) is spec_type]


class hide:
    """Make the CPU tier answer MISS for some (group, block) positions of ``ids``."""

    def __init__(self, llm: LLM, ids: list[int], positions: set[tuple[int, int]]) -> None:
        from pagedkv.engine.request import Request

        conn = llm.llm_engine.connector
        req = Request(
            request_id="probe",
            prompt_token_ids=ids,
            block_hasher=llm.llm_engine.block_hasher,
            sampling_params=PARAMS,
        )
        self.hidden = {k for g, b in positions for k in conn.layout.keys(req.block_hashes, g, [b])}
        self.manager = conn.manager
        self.real = conn.manager.lookup_many

    def lookup_many(self, keys: Sequence[bytes]) -> list[LookupResult]:
        out: list[LookupResult] = []
        for key, r in zip(keys, self.real(keys)):
            r = LookupResult.MISS if key in self.hidden else r
            out.append(out[-1] if out and not out[-1].is_hit else r)
        return out

    def __enter__(self) -> hide:
        self.manager.lookup_many = self.lookup_many
        return self

    def __exit__(self, *exc: object) -> None:
        del self.manager.lookup_many


def test_gemma2_cpu_tier_round_trip_is_exact(gemma: tuple[Any, Path]) -> None:
    """61 tokens, window 16, blocks of 4: the second run (device cache reset) loads 60 tokens
    from the CPU tier; hiding a sliding block inside the last window shrinks the hit to the
    last window without it, one far before it changes nothing, and a hidden global block
    caps it there. Every output is transformers'."""
    hf, path = gemma
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        num_kv_blocks=80,
        max_model_len=128,
        kv_offload="cpu:16MiB",
    )
    ids = prompt(1, 61)
    ref = hf_greedy(hf, ids, PARAMS.max_tokens)
    assert run(llm, ids) == (ref, 0)
    conn = llm.llm_engine.connector
    (sliding,), (full,) = group_of(llm, SlidingWindowSpec), group_of(llm, FullAttentionSpec)
    # Both groups stored their blocks: global all 15 full ones of the prompt, sliding those it
    # held when they filled (all of them, block by block).
    assert conn.num_stored_blocks >= 30
    for hidden, expect in [
        (set(), 60),
        ({(sliding, 13)}, 52),
        ({(sliding, 2)}, 60),
        ({(full, 5)}, 20),
    ]:
        assert llm.reset_prefix_cache()
        loaded = conn.num_loaded_tokens
        with hide(llm, ids, hidden):
            assert run(llm, ids) == (ref, expect), hidden
        assert conn.num_loaded_tokens - loaded == expect
    stats = llm.stats()
    assert stats["external_cache_hits"] > 0 and stats["offload"]["cpu"]["bytes_read"] > 0


def test_llama4_chunked_groups_round_trip_is_exact(llama4: tuple[Any, Path]) -> None:
    """Chunk 16: a hit at 60 tokens needs the chunked groups' blocks 12-14 only."""
    hf, path = llama4
    llm = LLM(
        model=str(path),
        block_size=BLOCK,
        num_kv_blocks=200,
        max_model_len=128,
        kv_offload="cpu:16MiB",
    )
    assert len(llm.llm_engine.kv_cache_config.kv_cache_groups) == 4
    ids = prompt(2, 61)
    ref = hf_greedy(hf, ids, PARAMS.max_tokens)
    assert run(llm, ids) == (ref, 0)
    chunked = group_of(llm, ChunkedLocalAttentionSpec)
    conn = llm.llm_engine.connector
    for hidden, expect in [(set(), 60), ({(chunked[0], 5)}, 60), ({(chunked[1], 13)}, 52)]:
        assert llm.reset_prefix_cache()
        with hide(llm, ids, hidden):
            assert run(llm, ids) == (ref, expect), hidden
    assert conn.num_loaded_tokens == 60 + 60 + 52


def test_disk_tier_restart_and_group_layout_fingerprint(
    gemma: tuple[Any, Path], tmp_path: Path
) -> None:
    """A new engine reads the hybrid model's chunks from disk (exact); a single-group model
    whose weights identity is the same (same directory name, same file sizes: only its
    layer types differ) finds none of them, and the hybrid model none of its."""
    from test_gemma2 import build

    from pagedkv.models.loader import model_identity

    hf, path = gemma
    spec = f"cpu:16MiB,disk:{tmp_path / 'kv'}:64MiB"
    engine = dict(block_size=BLOCK, num_kv_blocks=80, max_model_len=128, kv_offload=spec)
    ids = prompt(3, 61)
    ref = hf_greedy(hf, ids, PARAMS.max_tokens)

    def drained_run(llm: LLM, ids: list[int]) -> tuple[list[int], int]:
        out = run(llm, ids)
        assert llm.llm_engine.connector.manager.drain(20.0)
        llm.llm_engine.shutdown()
        return out

    first = LLM(model=str(path), **engine)
    assert drained_run(first, ids) == (ref, 0)
    second = LLM(model=str(path), **engine)
    assert run(second, ids) == (ref, 60)
    disk = second.stats()["offload"]["disk"]
    assert disk["hits"] > 0 and disk["bytes_read"] > 0
    second.llm_engine.shutdown()

    hf_full = build(_gemma_config(layer_types=["full_attention"] * 4))
    full_path = tmp_path / "other" / path.name
    hf_full.save_pretrained(full_path)
    single = LLM(model=str(full_path), **engine)
    assert len(single.llm_engine.kv_cache_config.kv_cache_groups) == 1
    # Only the layout differs: same weights identity, so the fingerprint's groups decide.
    assert single.llm_engine.connector.model_identity == model_identity(path)
    # Its oracle is the same model without tiers (KV never read from a tier is its own).
    plain = LLM(model=str(full_path), **(engine | {"kv_offload": None}))
    assert run(single, ids) == (run(plain, ids)[0], 0)
    stats = single.stats()["offload"]
    assert stats["loaded_tokens"] == 0 and stats["disk"]["hits"] == 0
    other = prompt(4, 61)  # a prompt only the single-group model runs
    assert drained_run(single, other)[1] == 0
    # The other way round: the hybrid model never reads the single-group model's chunks.
    third = LLM(model=str(path), **engine)
    assert run(third, other) == (hf_greedy(hf, other, PARAMS.max_tokens), 0)
    assert third.stats()["offload"]["disk"]["hits"] == 0
    third.llm_engine.shutdown()


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """test_bamba's tiny model (4 layers: Mamba 0, 2; attention 1, 3; blocks of 48 tokens)."""
    from test_bamba import tiny_config
    from transformers import BambaForCausalLM

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: one thread is fastest (as in test_bamba)
    torch.manual_seed(0)
    hf = BambaForCausalLM(tiny_config()).eval()
    with torch.no_grad():  # HF initialises these to constants: give them values that matter
        for layer in hf.model.layers:
            if hasattr(layer, "mamba"):
                layer.mamba.D.normal_(0, 1)
                layer.mamba.dt_bias.normal_(0, 1)
                layer.mamba.norm.weight.normal_(1, 0.3)
    out = tmp_path_factory.mktemp("tiny_bamba_offload")
    hf.save_pretrained(out)
    yield hf, out
    torch.set_num_threads(n)


@pytest.mark.parametrize("retention, hit", [(None, 96), (96, 96), (0, 0)])
def test_bamba_mamba_checkpoints_round_trip_is_exact(
    bamba: tuple[Any, Path], retention: int | None, hit: int
) -> None:
    """A 110-token prompt (blocks of 48): its second run resumes from the Mamba checkpoint at
    96 and the attention blocks before it, all from the CPU tier, and is transformers'. With
    retention 0 (end-of-step states) a tier load has no page to land in: recomputed, exact."""
    from test_bamba import hf_greedy as greedy

    hf, path = bamba
    llm = LLM(
        model=str(path),
        num_kv_blocks=40,
        max_model_len=256,
        kv_offload="cpu:64MiB",
        prefix_cache_retention_interval=retention,
    )
    ids = prompt(5, 110)
    ref = greedy(hf, ids, PARAMS.max_tokens)
    assert run(llm, ids) == (ref, 0)
    assert llm.reset_prefix_cache()
    assert run(llm, ids) == (ref, hit)
    assert llm.llm_engine.connector.num_loaded_tokens == hit
