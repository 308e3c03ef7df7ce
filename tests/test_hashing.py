"""Block hashing: functions, NONE_HASH seeding, chaining, extra keys, incremental hasher."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize(
    "name,size", [("sha256", 32), ("sha256_cbor", 32), ("xxhash", 16), ("xxhash_cbor", 16)]
)
def test_hash_functions_digest_sizes_and_determinism(name, size):
    fn = get_hash_fn_by_name(name)
    obj = (b"p" * 32, (1, 2, 3), None)
    assert len(fn(obj)) == size
    assert fn(obj) == fn(obj)
    assert fn(obj) != fn((b"p" * 32, (1, 2, 4), None))


def test_serialisations_match_the_documented_formats():
    import hashlib

    obj = (b"x", (1, 2), ("lora", "a", None))
    assert (
        sha256(obj) == hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    )
    assert sha256_cbor(obj) == hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def test_unknown_hash_name_is_a_clear_error():
    with pytest.raises(ValueError, match="sha256_cbor"):
        get_hash_fn_by_name("md5")


def _none_hash_in_subprocess(algo: str, seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    code = (
        "from pagedkv.core.hashing import get_none_hash, get_hash_fn_by_name;"
        f"print(get_none_hash(get_hash_fn_by_name('{algo}')).hex())"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_none_hash_agrees_across_processes_for_crypto_hashes():
    assert _none_hash_in_subprocess("sha256_cbor", None) == _none_hash_in_subprocess(
        "sha256_cbor", None
    )
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
    req = KVCacheRequest(
        "r",
        list(range(40)),
        lora_name="sql",
        lora_path="/p",
        cache_salt="salt",
        mm_features=[MultiModalFeature("img0", 4, 8), MultiModalFeature("img1", 14, 6)],
    )
    keys, idx = generate_block_hash_extra_keys(req, 0, 10)
    assert keys == (("lora", "sql", "/p"), ("mm", "img0", 4), ("cache_salt", "salt"))
    keys, idx = generate_block_hash_extra_keys(req, 10, 20, idx)
    assert keys == (("lora", "sql", "/p"), ("mm", "img0", -6), ("mm", "img1", 4))
    keys, _ = generate_block_hash_extra_keys(req, 20, 30, idx)
    assert keys == (("lora", "sql", "/p"),)
    assert to_event_extra_keys(
        (("lora", "sql", "/p"), ("mm", "img0", -6), ("cache_salt", "s"))
    ) == ["sql", ("img0", -6), "s"]
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
        expect = hash_block_tokens(counting, expect, req.all_token_ids[i * 8 : (i + 1) * 8])
    assert req.block_hashes[-1] == expect


def test_salt_only_changes_the_first_block_but_chains_through():
    h = get_request_block_hasher(4, sha256)
    a = KVCacheRequest("a", list(range(8)), block_hasher=h, cache_salt="x")
    b = KVCacheRequest("b", list(range(8)), block_hasher=h)
    assert a.block_hashes[0] != b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes[1] == hash_block_tokens(sha256, a.block_hashes[0], [4, 5, 6, 7])


def test_xxhash_is_used_consistently_within_a_process():
    assert get_none_hash(xxhash_) == get_none_hash(xxhash_)


# vLLM 0.33's block hashes for a 32-token prompt (tokens 1..16 then 17..32, block size 16),
# computed ONCE from vLLM's documented algorithm with hashlib + cbor2/pickle directly — no
# pagedkv code — and hard-coded here:
#   H_cbor(x) = sha256(cbor2.dumps(x, canonical=True)); H_pickle(x) = sha256(pickle.dumps(x, 5))
#   NONE_HASH = H("vllm-none-hash")            (PYTHONHASHSEED unset, cryptographic hash)
#   h0 = H((NONE_HASH, (1, ..., 16), E0));  h1 = H((h0, (17, ..., 32), E1))
# with the extra keys E in vLLM's tagged form and order (lora, mm, cache_salt; salt on block 0).
VLLM_033_VECTORS = {
    ("sha256_cbor", "plain"): (
        "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682",
        "2533ea50426b36e9e4d68296cac6bce8cf602e46957d0fe40b368b33d87bf3bf",
    ),
    ("sha256_cbor", "salt"): (  # cache_salt="tenant-a": E0 = (("cache_salt", "tenant-a"),)
        "d4fdd9f3dab139eafd01550f43781481256e9531b59b55ea4656df8f49124fcf",
        "2f4337ba796128f8f0f3e95e4b2e30a948abce017020918ad1ce0a6828f9edc7",
    ),
    (
        "sha256_cbor",
        "lora+salt",
    ): (  # E0 = (("lora","sql","/adapters/sql"), ("cache_salt","tenant-a"))
        "9cd699c12323c0c6f4045d0e1f0ecfc0ab3d00dce4223bf21c6a7cd889aaa3fb",
        "a0c8f2ff6ec84421b1db7653c99450f3db38245ae4971bab9a5432d000fb75c2",
    ),
    (
        "sha256_cbor",
        "mm",
    ): (  # item "img0" at tokens [10, 22): E0 = (("mm","img0",10),), E1 = (("mm","img0",-6),)
        "e0310d33a23693715af44f9c34a4ff4d679080c9ceea6a1f5d7da5c1120a861b",
        "8391e57d62af598ef58260fc5fde2c7fadd4e7378cd255c54fc566e4d31ac9ca",
    ),
    ("sha256", "plain"): (
        "7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf",
        "8e717becdc2054b7a3223b7b844f462c0db0ac86287b752b16d077ad0843c577",
    ),
    ("sha256", "salt"): (
        "67b47fff1fdd4b5d223a715393ac45d1f1159748b35948c1cc5af6f21812adb0",
        "c95bea24a5e5b77ca1ef0ac100eaf16646db162490a5668ca214b8232315c4d9",
    ),
    ("sha256", "lora+salt"): (
        "7d8804ff255b1be99987de779a78f688065590258e56fc253bd9ba69e706a4e9",
        "397db8048cc3b2d5afa6b412860a07e792e281ba05b77c581dfbf43b35c3ce8f",
    ),
}

_REQUEST_KWARGS = {
    "plain": "{}",
    "salt": "{'cache_salt': 'tenant-a'}",
    "lora+salt": "{'lora_name': 'sql', 'lora_path': '/adapters/sql', 'cache_salt': 'tenant-a'}",
    "mm": "{'mm_features': [MultiModalFeature('img0', 10, 12)]}",
}


def test_block_hashes_equal_vllm_033_bit_for_bit():
    """pagedkv's request block hashes equal vLLM 0.33's fixed vectors (sha256_cbor and sha256,
    PYTHONHASHSEED unset — removed from the child's environment, since pytest may set it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    lines = [
        "import json",
        "from pagedkv.core.hashing import get_hash_fn_by_name",
        "from pagedkv.core.request import KVCacheRequest, MultiModalFeature, get_request_block_hasher",
        "out = {}",
    ]
    for algo, case in VLLM_033_VECTORS:
        lines.append(
            f"r = KVCacheRequest('r', list(range(1, 33)), block_hasher=get_request_block_hasher("
            f"16, get_hash_fn_by_name('{algo}')), **{_REQUEST_KWARGS[case]})"
        )
        lines.append(f"out['{algo}|{case}'] = [h.hex() for h in r.block_hashes]")
    lines.append("print(json.dumps(out))")
    proc = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for (algo, case), want in VLLM_033_VECTORS.items():
        assert tuple(got[f"{algo}|{case}"]) == want, (algo, case)


def test_default_seed_is_vllms():
    assert hashing.DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert (
        _none_hash_in_subprocess("sha256_cbor", None)
        == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    )  # sha256_cbor("vllm-none-hash")
