"""A vLLM replica's KV cache configuration, read from what a vLLM server publishes.

vLLM has no ``GET /v1/kv_cache_config``. Its ``/metrics`` carries the ``vllm:cache_config_info``
gauge, whose labels are every `CacheConfig` field as a string (``block_size``,
``prefix_caching_hash_algo``, ``enable_prefix_caching``, ``num_gpu_blocks``, ...), and its
``/v1/models`` names the served model (``id``) and where it was loaded from (``root``). What
neither says comes from the router's flags (`apply_flags`):

* the hash seed: vLLM derives ``NONE_HASH`` from ``PYTHONHASHSEED`` when set, else from a fixed
  seed for sha256 / sha256_cbor and from random bytes for xxhash (per process: no router can
  mirror that; start the replicas with ``PYTHONHASHSEED=S`` and give the router
  ``--hash-seed S``);
* the KV event endpoints (vLLM's ``--kv-events-config`` is not published): ``--replica
  URL,events=tcp://HOST:PORT,replay=tcp://HOST:PORT``;
* the tokenizer: ``--tokenizer``, else the model's ``root`` when it is a local directory.

vLLM 0.32's CPU build uses block size 128 and ``prefix_caching_hash_algo`` sha256 by default:
pagedkv replicas in the same fleet must run with the same (``--block-size 128
--prefix-caching-hash-algo sha256``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pagedkv.core.hashing import DEFAULT_NONE_HASH_SEED, HASH_FUNCTIONS
from pagedkv.router.replica import ReplicaConfig, ReplicaSpec

CACHE_CONFIG_INFO = "vllm:cache_config_info"
CRYPTO_HASHES = ("sha256", "sha256_cbor")
_FLAGS = {  # the router's flag of each field
    "block_size": "--block-size",
    "hash_algo": "--prefix-caching-hash-algo",
    "hash_seed": "--hash-seed",
}


def cache_config_labels(metrics_text: str) -> dict[str, str] | None:
    """The labels of the first ``vllm:cache_config_info`` sample, or None without one."""
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name in (CACHE_CONFIG_INFO, CACHE_CONFIG_INFO.replace(":", "_")):
            for s in fam.samples:
                return dict(s.labels)
    return None


def config_from_vllm(metrics_text: str, models: dict[str, Any], spec: ReplicaSpec) -> ReplicaConfig:
    """A `ReplicaConfig` from a vLLM server's ``/metrics`` text and ``/v1/models`` JSON.
    ``hash_seed`` is None (vLLM does not publish it: `apply_flags` resolves it). ValueError when
    the server publishes no ``vllm:cache_config_info`` (not a vLLM server) or no model."""
    labels = cache_config_labels(metrics_text)
    if labels is None:
        raise ValueError(
            f"replica {spec.url}: no GET /v1/kv_cache_config and no {CACHE_CONFIG_INFO} on "
            f"/metrics: neither a pagedkv nor a vLLM server"
        )
    data = models.get("data") or []
    if not data:
        raise ValueError(f"replica {spec.url}: /v1/models lists no model")
    model = data[0]
    try:
        block_size = int(labels["block_size"])
    except (KeyError, ValueError):
        raise ValueError(
            f"replica {spec.url}: {CACHE_CONFIG_INFO} has no block_size label"
        ) from None
    try:
        num_blocks = int(labels.get("num_gpu_blocks", ""))
    except ValueError:
        num_blocks = 0  # unknown: the load term then counts requests, not blocks
    # vLLM publishes no event endpoints: only the spec's (``events=``, ``replay=``) are known.
    return ReplicaConfig(
        block_size=block_size,
        hash_algo=labels.get("prefix_caching_hash_algo") or "sha256",
        hash_seed=None,
        model=str(model.get("id", "")),
        model_path=str(model.get("root") or model.get("id", "")),
        model_identity=None,
        tokenizer=None,
        num_blocks=num_blocks,
        enable_prefix_caching=labels.get("enable_prefix_caching", "True") == "True",
        events=spec.events,
        replay=spec.replay,
        started=None,
        kind="vllm",
    )


def apply_flags(
    cfg: ReplicaConfig,
    block_size: int | None,
    hash_algo: str | None,
    hash_seed: str | None,
) -> ReplicaConfig:
    """``cfg`` with the router's ``--block-size`` / ``--hash-algo`` / ``--hash-seed`` filling
    what the replica does not report. A flag that contradicts what it reports, or a hash seed
    that cannot be known, is a ValueError saying which and what to do."""
    where = f"replica {cfg.model_path or cfg.model} ({cfg.kind})"
    for name, flag, mine in (
        ("block_size", block_size, cfg.block_size),
        ("hash_algo", hash_algo, cfg.hash_algo),
        ("hash_seed", hash_seed, cfg.hash_seed),
    ):
        if flag is not None and mine is not None and str(flag) != str(mine):
            raise ValueError(f"{where} reports {name}={mine!r} but {_FLAGS[name]} is {flag!r}")
    if cfg.hash_algo not in HASH_FUNCTIONS:
        raise ValueError(f"{where} hashes blocks with {cfg.hash_algo!r}, which pagedkv lacks")
    seed = cfg.hash_seed if cfg.hash_seed is not None else hash_seed
    if seed is None:
        if cfg.hash_algo not in CRYPTO_HASHES:
            raise ValueError(
                f"{where} hashes with {cfg.hash_algo}, whose seed is random per process unless "
                f"PYTHONHASHSEED is set: start it with PYTHONHASHSEED=S and give --hash-seed S"
            )
        seed = DEFAULT_NONE_HASH_SEED  # vLLM's seed for sha256 / sha256_cbor without one
    return replace(cfg, hash_seed=seed)
