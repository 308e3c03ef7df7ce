"""Block hashing for prefix caching: chained, content-addressed, deterministic across processes.

A block's hash fingerprints the *whole prefix* up to the end of that block:

    block_hashes[i] = hash_fn((block_hashes[i-1] or NONE_HASH, tuple(tokens_i), extra_keys_i))

so two requests share block ``i`` only if they agree on every token before it (and on every
extra key: LoRA adapter, multimodal items, cache salt). Hashes are computed once per block, when
the block becomes full (`get_request_block_hasher`), never at cache time.

Hash functions (vLLM's ``--prefix-caching-hash-algo`` names):

=============  =======================================  ===============
name           serialisation                            digest
=============  =======================================  ===============
sha256         pickle (highest protocol)                sha256, 32 B
sha256_cbor    canonical CBOR (the default; portable)   sha256, 32 B
xxhash         pickle                                   xxh3_128, 16 B
xxhash_cbor    canonical CBOR                           xxh3_128, 16 B
=============  =======================================  ===============

``NONE_HASH`` (the parent of block 0) is ``hash_fn(seed)``: the seed is ``PYTHONHASHSEED`` when
set; otherwise vLLM's fixed ``"vllm-none-hash"`` for the cryptographic hashes (so separate
processes and machines agree, a shared cache tier works, and KV-aware routers that recompute
vLLM's hashes from token ids get pagedkv's) and a random one for xxhash (non-cryptographic: a
fixed seed would let a client craft colliding prefixes across tenants).

Compatibility contract: with ``sha256_cbor`` or ``sha256`` and ``PYTHONHASHSEED`` unset, every
block hash equals vLLM 0.33's for the same tokens and extra keys, bit for bit
(``tests/test_hashing.py`` checks fixed vectors computed from vLLM's documented algorithm).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, NewType

import cbor2
import xxhash

from pagedkv import envs

BlockHash = NewType("BlockHash", bytes)
# A block hash namespaced by KV cache group: ``hash + group_id.to_bytes(4, "big")``.
BlockHashWithGroupId = bytes
HashFn = Callable[[Any], bytes]

# vLLM's DEFAULT_NONE_HASH_SEED: the same seed gives the same hashes as a vLLM instance.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


def sha256(obj: Any) -> bytes:
    """SHA-256 of the pickled object. Deterministic for tuples of bytes/ints/str/None."""
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of canonical CBOR: byte-identical across Python versions and languages."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_(obj: Any) -> bytes:
    """xxh3-128 of the pickled object: fast, non-cryptographic."""
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    """xxh3-128 of canonical CBOR."""
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash_,
    "xxhash_cbor": xxhash_cbor,
}
DEFAULT_HASH_ALGO = "sha256_cbor"


def get_hash_fn_by_name(name: str) -> HashFn:
    """Return the hash function called ``name``; ValueError lists the valid names."""
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown prefix caching hash algorithm {name!r}; choose one of {sorted(HASH_FUNCTIONS)}"
        ) from None


def hash_fn_name(hash_fn: HashFn) -> str:
    for name, fn in HASH_FUNCTIONS.items():
        if fn is hash_fn:
            return name
    return getattr(hash_fn, "__name__", "custom")


def _is_crypto(hash_fn: HashFn) -> bool:
    return hash_fn in (sha256, sha256_cbor)


# Seeds resolved once per process: a random xxhash seed must stay the same for the whole run,
# or the same prefix would hash differently between two requests.
_seeds: dict[bool, str] = {}
_none_hashes: dict[HashFn, BlockHash] = {}


def resolve_none_hash_seed(hash_fn: HashFn) -> str:
    """The seed behind ``NONE_HASH`` for ``hash_fn`` (see the module docstring)."""
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    crypto = _is_crypto(hash_fn)
    if crypto not in _seeds:
        _seeds[crypto] = DEFAULT_NONE_HASH_SEED if crypto else os.urandom(32).hex()
    return _seeds[crypto]


def get_none_hash(hash_fn: HashFn) -> BlockHash:
    """``NONE_HASH`` for ``hash_fn``: the parent hash of every request's first block."""
    h = _none_hashes.get(hash_fn)
    if h is None:
        h = _none_hashes[hash_fn] = BlockHash(hash_fn(resolve_none_hash_seed(hash_fn)))
    return h


def init_none_hash(hash_fn: HashFn) -> BlockHash:
    """(Re)compute ``NONE_HASH`` for ``hash_fn`` from the current environment and make it the
    module-level ``NONE_HASH``. Tests call this after changing ``PYTHONHASHSEED``."""
    global NONE_HASH, _NONE_HASH_FN
    _seeds.clear()
    _none_hashes.clear()
    NONE_HASH = get_none_hash(hash_fn)
    _NONE_HASH_FN = hash_fn
    return NONE_HASH


def get_none_hash_seed() -> str:
    """The seed used for the current module-level ``NONE_HASH``."""
    return resolve_none_hash_seed(_NONE_HASH_FN)


_NONE_HASH_FN: HashFn = get_hash_fn_by_name(DEFAULT_HASH_ALGO)
NONE_HASH: BlockHash = get_none_hash(_NONE_HASH_FN)


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: bytes | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """The chained hash of one full block: ``hash_fn((parent or NONE_HASH, tokens, extra))``."""
    if parent_block_hash is None:
        parent_block_hash = get_none_hash(hash_fn)
    return BlockHash(hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys)))


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> BlockHashWithGroupId:
    return block_hash + group_id.to_bytes(4, "big")


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big")


def maybe_convert_block_hash(block_hash: bytes) -> bytes | int:
    """External form of a hash for KV events: a 64-bit int when
    ``PAGEDKV_KV_EVENTS_USE_INT_BLOCK_HASHES`` is set (routers that key by int), else bytes."""
    if envs.PAGEDKV_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
    return block_hash
