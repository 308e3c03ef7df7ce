"""A prompt's block hashes, computed exactly as a replica computes them and reports them in KV events.

The engine hashes a request's full blocks with `pagedkv.core.request.get_request_block_hasher`:
``h_i = hash_fn((h_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys_i))`` with
``NONE_HASH = hash_fn(seed)``. The router is a separate process, so it must use the *replica's*
algorithm and seed (read from its ``/v1/kv_cache_config``), never its own process defaults: with
xxhash a replica's seed is random per process.

External form: KV events carry a hash as bytes, or as a 64-bit int when the replica sets
``PAGEDKV_KV_EVENTS_USE_INT_BLOCK_HASHES`` (`pagedkv.core.hashing.maybe_convert_block_hash`). The
router keys everything by that 64-bit int (`to_external`), whatever form a replica sends, so
replicas with either setting share one index.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core.hashing import get_hash_fn_by_name, resolve_none_hash_seed

_MASK64 = (1 << 64) - 1


def to_external(block_hash: bytes | int) -> int:
    """The router's key of a block hash: the low 64 bits of its big-endian value (the int form
    `maybe_convert_block_hash` produces), for a bytes or an int hash alike."""
    if isinstance(block_hash, int):
        return block_hash & _MASK64
    return int.from_bytes(block_hash, "big") & _MASK64


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    hash_fn_name: str,
    hash_seed: str | None,
    cache_salt: str | None = None,
    lora: tuple[str, str | None] | None = None,
) -> list[int]:
    """The external (64-bit int) hashes of every full block of ``token_ids``: the ints the
    replica puts in its BlockStored events for these tokens.

    ``hash_seed``: the replica's NONE_HASH seed (None: this process's resolution, which equals
    the replica's only for sha256/sha256_cbor without ``PYTHONHASHSEED``). ``cache_salt`` and
    ``lora`` (name, path) add the engine's extra keys (the salt to block 0, the adapter to
    every block), in `generate_block_hash_extra_keys`'s order. Multimodal items are not
    supported (the router routes text)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hash_fn = get_hash_fn_by_name(hash_fn_name)
    seed = resolve_none_hash_seed(hash_fn) if hash_seed is None else hash_seed
    parent: bytes = hash_fn(seed)
    out: list[int] = []
    for i in range(len(token_ids) // block_size):
        keys: list[object] = []
        if lora is not None:
            keys.append(("lora", lora[0], lora[1]))
        if i == 0 and cache_salt is not None:
            keys.append(("cache_salt", cache_salt))
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = hash_fn((parent, block, tuple(keys) if keys else None))
        out.append(to_external(parent))
    return out
