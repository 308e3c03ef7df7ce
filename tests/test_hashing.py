"""Block hashing: functions, NONE_HASH seeding, chaining, extra keys, incremental hasher."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import cbor2
import pytest

from pagedkv.core import hashing
from pagedkv.core.hashing import (
    get_hash_fn_by_name,
    get_none_hash,
    hash_block_tokens,
    init_none_hash,
    sha256,
    sha256_cbor,
    xxhash_,
)
from pagedkv.core.request import (
    KVCacheRequest,
    MultiModalFeature,
    generate_block_hash_extra_keys,
    get_request_block_hasher,
    to_event_extra_keys,
)


@pytest.mark.parametrize("name,size", [("sha256", 32), ("sha256_cbor", 32), ("xxhash", 16),
                                       ("xxhash_cbor", 16)])
def test_hash_functions_digest_sizes_and_determinism(name, size):
    fn = get_hash_fn_by_name(name)
    obj = (b"p" * 32, (1, 2, 3), None)
    assert len(fn(obj)) == size
    assert fn(obj) == fn(obj)
    assert fn(obj) != fn((b"p" * 32, (1, 2, 4), None))


def test_serialisations_match_the_documented_formats():
    import hashlib
    obj = (b"x", (1, 2), ("lora", "a", None))
    assert sha256(obj) == hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert sha256_cbor(obj) == hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def test_unknown_hash_name_is_a_clear_error():
    with pytest.raises(ValueError, match="sha256_cbor"):
        get_hash_fn_by_name("md5")


def _none_hash_in_subprocess(algo: str, seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    code = ("from pagedkv.core.hashing import get_none_hash, get_hash_fn_by_name;"
            f"print(get_none_hash(get_hash_fn_by_name('{algo}')).hex())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_none_hash_agrees_across_processes_for_crypto_hashes():
    assert _none_hash_in_subprocess("sha256_cbor", None) == _none_hash_in_subprocess("sha256_cbor", None)
    assert _none_hash_in_subprocess("sha256", None) == sha256(hashing.DEFAULT_NONE_HASH_SEED).hex()


def test_none_hash_xxhash_random_unless_seeded():
    assert _none_hash_in_subprocess("xxhash", None) != _none_hash_in_subprocess("xxhash", None)
    assert _none_hash_in_subprocess("xxhash", "7") == _none_hash_in_subprocess("xxhash", "7")
    assert _none_hash_in_subprocess("sha256", "7") == sha256("7").hex()


def test_init_none_hash_follows_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    try:
        assert init_none_hash(sha256) == sha256("1234")
        assert hashing.get_none_hash_seed() == "1234"
        assert hashing.NONE_HASH == sha256("1234")
    finally:
        monkeypatch.delenv("PYTHONHASHSEED")
        init_none_hash(sha256_cbor)
    assert hashing.get_none_hash_seed() == hashing.DEFAULT_NONE_HASH_SEED


def test_chained_hash():
    a = hash_block_tokens(sha256, None, [1, 2])
    b = hash_block_tokens(sha256, a, [3, 4])
    assert b == sha256((a, (3, 4), None))
    assert hash_block_tokens(sha256, None, [3, 4]) != b  # same tokens, other prefix
    assert hash_block_tokens(sha256, a, [3, 4], ("cache_salt", "s")) != b


def test_extra_keys_order_mm_offsets_and_salt():
    req = KVCacheRequest("r", list(range(40)), lora_name="sql", lora_path="/p", cache_salt="salt",
                         mm_features=[MultiModalFeature("img0", 4, 8), MultiModalFeature("img1", 14, 6)])
    keys, idx = generate_block_hash_extra_keys(req, 0, 10)
    assert keys == (("lora", "sql", "/p"), ("mm", "img0", 4), ("cache_salt", "salt"))
    keys, idx = generate_block_hash_extra_keys(req, 10, 20, idx)
    assert keys == (("lora", "sql", "/p"), ("mm", "img0", -6), ("mm", "img1", 4))
    keys, _ = generate_block_hash_extra_keys(req, 20, 30, idx)
    assert keys == (("lora", "sql", "/p"),)
    assert to_event_extra_keys((("lora", "sql", "/p"), ("mm", "img0", -6), ("cache_salt", "s"))) == \
        ["sql", ("img0", -6), "s"]
    plain = KVCacheRequest("p", [1, 2, 3])
    assert generate_block_hash_extra_keys(plain, 0, 3) == (None, 0)


def test_incremental_hasher_hashes_each_full_block_once():
    calls = []

    def counting(obj):
        calls.append(obj)
        return sha256(obj)

    req = KVCacheRequest("r", list(range(20)), block_hasher=get_request_block_hasher(8, counting))
    assert len(req.block_hashes) == 2 and len(calls) == 2 + 1  # + NONE_HASH seed
    req.append_output_token_ids([100, 101, 102])
    assert len(req.block_hashes) == 2
    req.append_output_token_ids(103)
    assert len(req.block_hashes) == 3 and len(calls) == 4
    expect = None
    for i in range(3):
        expect = hash_block_tokens(counting, expect, req.all_token_ids[i * 8:(i + 1) * 8])
    assert req.block_hashes[-1] == expect


def test_salt_only_changes_the_first_block_but_chains_through():
    h = get_request_block_hasher(4, sha256)
    a = KVCacheRequest("a", list(range(8)), block_hasher=h, cache_salt="x")
    b = KVCacheRequest("b", list(range(8)), block_hasher=h)
    assert a.block_hashes[0] != b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes[1] == hash_block_tokens(sha256, a.block_hashes[0], [4, 5, 6, 7])


def test_xxhash_is_used_consistently_within_a_process():
    assert get_none_hash(xxhash_) == get_none_hash(xxhash_)
